"""``nclip sweep``: ablation grids (xCLIP Sec. 4.4, Tab. 9 a/b/e; Appendix Tab. A1 and Fig. B1).

    grid / named settings → one ``nclip train`` subprocess per setting → linear probe → judge
    → DIR/table.md + DIR/table.csv (Tab. 9 layout) + DIR/curves.png (Fig. B1) + DIR/sweep.json

A sweep is a list of runs. Each run is a set of config overrides, the cartesian product of

- a *grid*: ``--grid "objective.lambda1=[0,0.3,0.5] objective.lambda2=[1,1.5]"`` (every key
  takes a YAML list of values; the option may be repeated), and
- optional *named settings*: whole configs by name, from ``--table a1`` (the rows of Tab. A1,
  :data:`nclip.objectives.unified.TABLE_A1_SETTINGS`), ``--table 9a`` / ``--table 9e`` (the rows
  of Tab. 9a / 9e, which are not cartesian products) or a ``--grid-file`` (see :func:`load_grid_file`).

Every run trains in ``DIR/runs/<slug>`` as its own ``nclip train`` process (``N`` at once, each with
``train.threads`` threads), so a crash, a divergence or a bad setting stops one run, not the sweep.
Each run is then scored like Tab. 9: ZS = zero-shot top-1 of the objective's zero-shot head, from
the trainer's RUN/eval.json; LN = a linear probe (L-BFGS logistic regression, L2 chosen on a
validation split) on frozen image-backbone features of held-out built-in data, written to
RUN/probe.json by the sweep process itself (:func:`probe_run`).

Verdicts (the "NaN" rows of Tab. 9a / Tab. A1), from the run's metrics.jsonl:

- ``diverged``: the trainer stopped on non-finite losses or gradients, or the last logged loss or
  nCLIP term is not finite. ZS/LN read ``NaN``.
- ``collapsed (uniform)`` / ``collapsed (one-hot)``: :class:`~nclip.train.monitors.CollapseMonitor`
  still reports that signature at the end of training (it persisted over its last ``window``
  logs). ZS/LN read ``collapsed``; the measured numbers stay in table.csv (``*_measured``).
- ``dimensional collapse``: reported as a note with the numbers, as the paper reports its
  λ1 > 0, λ2 = 1 rows (Appendix B.1, case 2).
- ``failed``: the process failed for another reason (its stderr tail is in RUN/error.txt).

Resume (``--resume``): runs that are ``done`` or ``diverged`` are skipped; every other run (pending,
interrupted, failed) is started again with ``nclip train --resume auto`` (it continues from its
newest checkpoint); a run whose training finished but whose probe did not only runs the probe.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import yaml

from nclip.errors import NclipError
from nclip.jsonio import jsonable
from nclip.objectives import REGISTRY

SWEEP_VERSION = 1
FINISHED = ("done", "diverged")  # skipped by --resume
TERM_KEYS = ("L_KL", "L_EH", "L_HE", "row_std", "col_std", "usage")


# ---------------------------------------------------------------------------------------------
# built-in tables
# ---------------------------------------------------------------------------------------------


def table_settings(name: str) -> dict[str, dict[str, Any]]:
    """Named settings of a paper table: ``a1`` (Appendix Tab. A1, objective ``unified``), ``9a``
    (Tab. 9a: the five (λ1, λ2) rows) or ``9e`` (Tab. 9e: λ_CLIP with λ_nCLIP = 1, objective xclip)."""
    key = name.lower().removeprefix("tab").removeprefix(".").strip()
    if key == "a1":
        from nclip.objectives.unified import TABLE_A1_SETTINGS

        return {row: {"objective": {"name": "unified", **values}} for row, values in TABLE_A1_SETTINGS.items()}
    if key == "9a":
        rows = [(0, 1), (0.3, 1), (0.5, 1), (0.2, 1.2), (0.5, 1.5)]
        return {f"l1-{a:g}_l2-{b:g}": {"objective.lambda1": a, "objective.lambda2": b} for a, b in rows}
    if key == "9e":
        return {f"wclip-{w:g}": {"objective.w_clip": w, "objective.w_nclip": 1.0} for w in (1.0, 0.5, 0.2, 0.1)}
    raise NclipError(f"unknown table {name!r}; available: a1, 9a, 9e")


# ---------------------------------------------------------------------------------------------
# grid parsing
# ---------------------------------------------------------------------------------------------

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_OPEN, _CLOSE = "[{(", "]})"


def split_grid(text: str) -> list[str]:
    """Split a --grid string at whitespace outside brackets, braces and quotes."""
    items, cur, depth, quote = [], [], 0, None
    for ch in text:
        if quote:
            cur.append(ch)
            if ch == quote:
                quote = None
            continue
        if ch in "'\"":
            quote = ch
        elif ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth -= 1
            if depth < 0:
                raise NclipError(f"grid {text!r}: unbalanced {ch!r}")
        if ch.isspace() and depth == 0:
            if cur:
                items.append("".join(cur))
                cur = []
            continue
        cur.append(ch)
    if quote or depth:
        raise NclipError(f"grid {text!r}: unclosed {'quote' if quote else 'bracket'}")
    if cur:
        items.append("".join(cur))
    return items


def _check_values(key: str, values: Any, where: str) -> list:
    if not isinstance(values, list):
        raise NclipError(f"{where}: the value must be a YAML list of values, e.g. {key}=[{_fmt(values)}]")
    if not values:
        raise NclipError(f"{where}: the list of values is empty")
    seen = []
    for v in values:
        if v in seen:
            raise NclipError(f"{where}: value {_fmt(v)} is listed twice")
        seen.append(v)
    return values


def _check_key(key: str, where: str) -> str:
    if not _KEY.match(key):
        raise NclipError(f"{where}: {key!r} is not a config key like objective.lambda1")
    return key


def parse_grid(texts: Iterable[str]) -> dict[str, list]:
    """``["objective.lambda1=[0,0.3] objective.lambda2=[1,1.5]"]`` → {key: [values]} (ordered)."""
    grid: dict[str, list] = {}
    for text in texts:
        items = split_grid(text)
        if not items:
            raise NclipError("grid: empty --grid")
        for item in items:
            key, sep, value = item.partition("=")
            where = f"grid entry {item!r}"
            if not sep or not key:
                raise NclipError(f"{where} is not of the form key=[v1,v2,...]")
            key = _check_key(key.strip(), where)
            try:
                values = yaml.safe_load(value)
            except yaml.YAMLError:
                raise NclipError(f"{where}: cannot parse {value!r} as a YAML list") from None
            if key in grid:
                raise NclipError(f"{where}: key {key} is given twice")
            grid[key] = _check_values(key, values, where)
    _check_nesting(list(grid), "grid")
    return grid


def _check_nesting(keys: list[str], where: str) -> None:
    for a in keys:
        for b in keys:
            if a != b and b.startswith(a + "."):
                raise NclipError(f"{where}: {a} and {b} overlap (one is a section of the other)")


def load_grid_file(path: str | Path) -> tuple[dict[str, list], dict[str, dict] | None]:
    """(grid, settings) from a YAML file::

        grid:                         # optional: a cartesian product, as --grid
          objective.lambda1: [0, 0.3, 0.5]
        settings:                     # optional: named whole configs (dotted keys or sections)
          SwAV: {objective: {name: unified, tau_s: 0.25, uniform: sinkhorn, lambda2: 1}}
          nCLIP: {objective.name: nclip}
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise NclipError(f"grid file not found: {p}")
    try:
        doc = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise NclipError(f"cannot parse {p}: {str(e).splitlines()[0]}") from None
    if not isinstance(doc, dict) or not doc or set(doc) - {"grid", "settings"}:
        raise NclipError(f"{p}: the top level must be a mapping with the keys 'grid' and/or 'settings'")
    grid: dict[str, list] = {}
    raw_grid = doc.get("grid") or {}
    if not isinstance(raw_grid, dict):
        raise NclipError(f"{p}: 'grid' must map config keys to lists of values")
    for key, values in raw_grid.items():
        where = f"{p}: grid key {key!r}"
        grid[_check_key(str(key), where)] = _check_values(str(key), values, where)
    _check_nesting(list(grid), f"{p}: grid")
    settings = doc.get("settings")
    if settings is not None:
        if not isinstance(settings, dict) or not settings:
            raise NclipError(f"{p}: 'settings' must map names to config overrides")
        for name, over in settings.items():
            if not isinstance(over, dict):
                raise NclipError(f"{p}: setting {name!r} must be a mapping of config keys to values")
            for key in over:
                _check_key(str(key), f"{p}: setting {name!r}")
        settings = {str(k): v for k, v in settings.items()}
    if not grid and not settings:
        raise NclipError(f"{p}: neither a grid nor settings")
    return grid, settings


# ---------------------------------------------------------------------------------------------
# runs
# ---------------------------------------------------------------------------------------------


@dataclass
class RunSpec:
    """One run of a sweep: its overrides (dotted key → Python value, applied in order)."""

    slug: str
    name: str | None  # named setting (e.g. a Tab. A1 row), if any
    assign: dict[str, Any]  # this run's overrides (setting first, then the grid point)
    values: dict[str, Any] = field(default_factory=dict)  # flattened, for the table (varied keys only)

    def set_args(self) -> list[str]:
        return [f"{k}={_yaml_flow(v)}" for k, v in self.assign.items()]


def _yaml_flow(value: Any) -> str:
    """A value as a one-line YAML string that yaml.safe_load turns back into the same value."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30, allow_unicode=True)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return _yaml_flow(value)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (int, str)):
        return str(value)
    return _yaml_flow(value)


def _flatten(assign: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def walk(prefix: str, v: Any):
        if isinstance(v, dict) and v:
            for k, sub in v.items():
                walk(f"{prefix}.{k}", sub)
        else:
            out[prefix] = v

    for k, v in assign.items():
        walk(k, v)
    return out


def field_title(key: str) -> str | None:
    """The symbol of a config key in the papers (its field's ``title``: λ1, τ_s, dim, ...), if it has one.
    An ``objective.*`` key is looked up in every registered objective's config."""
    from nclip.config import RunConfig

    *path, name = key.split(".")
    if path == ["objective"]:
        configs = [config for config, _ in REGISTRY.values()]
    else:
        section = RunConfig
        for part in path:
            info = section.model_fields.get(part)
            section = info.annotation if info is not None else None
            if not isinstance(section, type):
                return None
        configs = [section]
    titles = [c.model_fields[name].title for c in configs if name in getattr(c, "model_fields", {})]
    return next((t for t in titles if t), None)


def short_names(keys: list[str]) -> dict[str, str]:
    """key → its last component, or the whole key where two keys share a last component."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: (tail if last.count(tail) == 1 else k) for k, tail in zip(keys, last)}


def expand(grid: dict[str, list], settings: dict[str, dict] | None = None) -> list[RunSpec]:
    """The runs: named settings (or one unnamed) × the cartesian product of the grid."""
    import itertools

    named = list((settings or {None: {}}).items())
    points = [dict(zip(grid, combo)) for combo in itertools.product(*grid.values())] if grid else [{}]
    runs = []
    for name, over in named:
        for point in points:
            runs.append(RunSpec(slug="", name=name, assign={**over, **point}))
    # the table's columns: every (flattened) grid key, and the setting keys whose values differ
    flats = [_flatten(r.assign) for r in runs]
    grid_flats = [_flatten({k: r.assign[k] for k in grid}) for r in runs]
    keys: list[str] = []
    for f in grid_flats + flats:
        keys += [k for k in f if k not in keys]
    varied = [k for k in keys if any(k in g for g in grid_flats) or len({_fmt(f.get(k)) for f in flats}) > 1]
    used: set[str] = set()
    for run, flat, gflat in zip(runs, flats, grid_flats):
        run.values = {k: flat.get(k) for k in varied}
        # the slug: the setting's name, then the grid point as short-key-value pairs
        names = short_names(list(gflat))
        parts = ([run.name] if run.name is not None else []) + [f"{names[k]}-{_fmt(v)}" for k, v in gflat.items()]
        slug = "_".join(re.sub(r"[^A-Za-z0-9._+-]+", "-", p).strip("-") for p in parts)[:120] or "run"
        base, n = slug, 1
        while slug in used:
            n += 1
            slug = f"{base}_{n}"
        used.add(slug)
        run.slug = slug
    return runs


# ---------------------------------------------------------------------------------------------
# judging a run from its files
# ---------------------------------------------------------------------------------------------


def read_metrics(path: Path) -> list[dict]:
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and "step" in row:
                rows.append(row)
    return rows


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def judge(rows: list[dict], cfg, stderr: str = "") -> dict:
    """Verdict of a run from its logged metrics (and the trainer's stderr when it failed).

    Returns {"verdict": ok | dimensional | uniform | one_hot | diverged, "collapse": [kinds active
    at the end], "warned": {kind: step}, "final": {L_KL, ..., loss, step}, "nonfinite_steps": n}.
    """
    from nclip.train.monitors import CollapseMonitor

    final: dict[str, float] = {}
    out = {"verdict": "ok", "collapse": [], "warned": {}, "final": final, "nonfinite_steps": 0}
    if not rows:
        if "non-finite" in stderr:
            out["verdict"] = "diverged"
        return out
    last = rows[-1]
    monitor = CollapseMonitor.for_run(cfg)
    prefix = monitor.prefix if monitor is not None and f"{monitor.prefix}/L_HE" in last else None
    final["step"] = last.get("step")
    final["loss"] = last.get("loss")
    if prefix:
        for k in TERM_KEYS:
            final[k] = last.get(f"{prefix}/{k}")
        for row in rows:
            monitor.update(int(row["step"]), row)
        out["collapse"] = sorted(monitor.active)
        out["warned"] = dict(monitor.warned)
    out["nonfinite_steps"] = int(last.get("nonfinite_steps", 0) or 0)
    watched = [final.get("loss")] + [final.get(k) for k in ("L_KL", "L_EH", "L_HE") if prefix]
    if "non-finite" in stderr or any(v is not None and not _finite(v) for v in watched):
        out["verdict"] = "diverged"
    elif "uniform" in out["collapse"]:
        out["verdict"] = "uniform"
    elif "one_hot" in out["collapse"]:
        out["verdict"] = "one_hot"
    elif "dimensional" in out["collapse"]:
        out["verdict"] = "dimensional"
    return out


# ---------------------------------------------------------------------------------------------
# linear probe
# ---------------------------------------------------------------------------------------------


def _probe_dataset(cfg) -> tuple[str, str]:
    return ("digits", "digit") if cfg.data.source == "digits" else ("synthetic", "shape")


def probe_run(run_dir: str | Path, train_samples: int = 2000, test_samples: int = 1000, seed: int | None = None,
              device: str = "cpu") -> dict:
    """Linear probe (Tab. 9's LN) on frozen image-backbone features of held-out built-in data.

    The protocol of ``nclip eval --tasks linear`` (:func:`nclip.eval.probe.linear`: L-BFGS
    logistic regression, L2 picked on a stratified validation split, refit) on the primary label
    kind only (shape for synthetic scenes, digit for digits), which is what Tab. 9's LN column
    reports; the full evaluation probes every label kind. Synthetic scenes are drawn with seed
    ``cfg.seed + 1`` (default), so neither the probe's training nor its test images were seen in
    pre-training; digits use the run's own held-out split.
    """
    import torch

    from nclip.eval.features import extract
    from nclip.models.io import load_model

    t = time.perf_counter()
    run_dir = Path(run_dir)
    model, cfg = load_model(run_dir / "model", device=device)
    dataset, kind = _probe_dataset(cfg)
    seed = cfg.seed + 1 if seed is None else seed
    if dataset == "digits":
        from nclip.data.digits import DigitsPairs

        make = lambda split, n: DigitsPairs(split, seed=cfg.seed, image_size=cfg.data.image_size, val_fraction=0.0)  # noqa: E731
    else:
        from nclip.data.synthetic import SyntheticScenes

        # faithful captions only, as nclip.eval.datasets.synthetic (the captions are not used here)
        make = lambda split, n: SyntheticScenes(split=split, length=n, seed=seed, image_size=cfg.data.image_size,  # noqa: E731
                                                max_objects=cfg.data.max_objects, loose_caption_prob=0.0)
    train, test = make("train", train_samples), make("test", test_samples)
    dev = torch.device(device)
    ftr = extract(model, train, cfg.data.image_size, dev, texts=False)
    fte = extract(model, test, cfg.data.image_size, dev, texts=False)
    n_cls = len(test.label_spaces[kind])
    args = (ftr.image["features"], ftr.labels[kind], fte.image["features"], fte.labels[kind], n_cls)
    try:
        from nclip.eval.probe import linear

        r = linear(*args, seed=seed)
        protocol = "nclip.eval.probe.linear"
    except ImportError:  # pragma: no cover - a checkout without the eval protocols
        from nclip.eval.metrics import linear_probe

        r = linear_probe(*args, val_fraction=0.2, seed=seed)
        protocol = "nclip.eval.metrics.linear_probe"
    return {"linear/top1": float(r["top1"]), "linear/mean_per_class": float(r["mean_per_class"]),
            "linear/l2": float(r["l2"]), "dataset": f"{dataset}-{kind}", "train_samples": len(train),
            "test_samples": len(test), "seed": seed, "features": "image backbone ([CLS], frozen)",
            "protocol": protocol, "wall_s": time.perf_counter() - t}


# ---------------------------------------------------------------------------------------------
# the sweep
# ---------------------------------------------------------------------------------------------


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS / Windows
        return os.cpu_count() or 1


def plan_parallelism(cores: int, parallel: int | None, threads: int | None) -> tuple[int, int]:
    """(runs at once N, threads per run T): N = max(1, cores // T) with T = 1 unless given;
    with only N given, T = max(1, cores // N)."""
    if parallel is not None and parallel < 1:
        raise NclipError(f"--parallel must be >= 1, got {parallel}")
    if threads is not None and threads < 1:
        raise NclipError(f"--threads must be >= 1, got {threads}")
    if threads is None:
        threads = max(1, cores // parallel) if parallel else 1
    if parallel is None:
        parallel = max(1, cores // threads)
    return parallel, threads


@dataclass
class SweepOptions:
    preset: str
    out: Path
    grid: dict[str, list] = field(default_factory=dict)
    settings: dict[str, dict] | None = None
    overrides: list[str] = field(default_factory=list)
    parallel: int | None = None
    threads: int | None = None
    resume: bool = False
    probe_train: int = 2000
    probe_test: int = 1000
    source: dict = field(default_factory=dict)  # how the grid was given (for sweep.json)


class _Journal:
    """DIR/sweep.json, rewritten atomically after every change of a run's status."""

    def __init__(self, path: Path, doc: dict):
        self.path, self.doc, self.lock = path, doc, threading.Lock()
        self.write()

    def run(self, slug: str) -> dict:
        return next(r for r in self.doc["runs"] if r["slug"] == slug)

    def update(self, slug: str, **fields) -> None:
        with self.lock:
            self.run(slug).update(fields)
            self.write()

    def write(self) -> None:
        self.doc["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(jsonable(self.doc, str), indent=2) + "\n")
        os.replace(tmp, self.path)


def _tail(path: Path, lines: int = 40) -> str:
    if not path.is_file():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


class _Children:
    """The sweep's live ``nclip train`` processes, so that Ctrl-C or SIGTERM to the sweep ends them
    too (instead of leaving orphans that keep training)."""

    def __init__(self):
        self.lock, self.procs, self.stopping = threading.Lock(), set(), False

    def run(self, cmd: list[str], **kwargs) -> int:
        with self.lock:
            if self.stopping:
                return -signal.SIGTERM
            proc = subprocess.Popen(cmd, **kwargs)
            self.procs.add(proc)
        try:
            return proc.wait()
        finally:
            with self.lock:
                self.procs.discard(proc)

    def terminate(self) -> None:
        with self.lock:
            self.stopping = True
            for proc in self.procs:
                proc.terminate()  # SIGTERM: the run keeps its last complete checkpoint


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _subprocess_env(threads: int) -> dict:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    return env


def train_command(opts: SweepOptions, run: RunSpec, threads: int, resume: bool) -> list[str]:
    """The ``nclip train`` argv of one run (``python -m nclip`` of this interpreter)."""
    cmd = [sys.executable, "-m", "nclip", "train", "--preset", opts.preset, "--out",
           str(opts.out / "runs" / run.slug), "--no-progress"]
    sets = list(opts.overrides) + run.set_args()
    if "train.threads" not in _flatten(run.assign):
        sets.append(f"train.threads={threads}")
    for s in sets:
        cmd += ["--set", s]
    if resume:
        cmd += ["--resume", "auto"]
    return cmd


def _display(cmd: list[str]) -> str:
    return shlex.join(["nclip", *cmd[3:]])


def _resolve(opts: SweepOptions, run: RunSpec):
    from nclip.config import resolve

    try:
        return resolve(opts.preset, list(opts.overrides) + run.set_args())
    except NclipError as e:
        raise NclipError(f"run {run.slug}: {e}") from None


def run_sweep(opts: SweepOptions, log: Callable[[str], None] = print) -> dict:
    """Run (or resume) a sweep; returns the sweep.json document. See the module docstring."""
    t0 = time.perf_counter()
    runs = expand(opts.grid, opts.settings)
    if not runs or (not opts.grid and not opts.settings):
        raise NclipError("nothing to sweep: give --grid, --grid-file or --table")
    configs = {r.slug: _resolve(opts, r) for r in runs}  # every config is valid before anything runs
    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    with _exclusive(out):
        return _run_sweep(opts, runs, configs, log, t0)


class _exclusive:
    """An advisory lock on DIR/.sweep.lock: two sweeps never write the same directory."""

    def __init__(self, out: Path):
        self.path = out / ".sweep.lock"

    def __enter__(self):
        self.fh = open(self.path, "a+")
        try:
            import fcntl

            fcntl.flock(self.fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:  # pragma: no cover - not POSIX: no lock
            pass
        except OSError:
            self.fh.close()
            raise NclipError(f"another nclip sweep is running in {self.path.parent}") from None
        return self

    def __exit__(self, *exc):
        self.fh.close()  # releases the lock
        return False


def _run_sweep(opts: SweepOptions, runs: list[RunSpec], configs: dict, log: Callable[[str], None], t0: float) -> dict:
    out = opts.out
    journal_path = out / "sweep.json"
    previous: dict[str, dict] = {}
    old: dict = {}
    if journal_path.exists():
        if not opts.resume:
            raise NclipError(f"{out} already holds a sweep (sweep.json): pass --resume to continue it, "
                             f"or choose another --out")
        try:
            old = json.loads(journal_path.read_text())
        except ValueError:
            raise NclipError(f"{journal_path} is not valid JSON") from None
        if old.get("preset") != opts.preset or old.get("overrides") != list(opts.overrides):
            raise NclipError(f"--resume: {journal_path} was started with --preset {old.get('preset')} and "
                             f"--set {old.get('overrides')}; resume it with the same options")
        previous = {r["slug"]: r for r in old.get("runs", [])}
        for r in runs:
            if r.slug in previous and previous[r.slug].get("overrides") != r.set_args():
                raise NclipError(f"--resume: run {r.slug} was started with other overrides "
                                 f"({previous[r.slug].get('overrides')}); use a new --out")
    elif (out / "runs").is_dir() and any((out / "runs").iterdir()):
        raise NclipError(f"{out}/runs is not empty but has no sweep.json; choose another --out")

    cores = available_cores()
    from nclip.config import resolve

    base_threads = resolve(opts.preset, list(opts.overrides)).train.threads  # a preset or --set may fix it
    parallel, threads = plan_parallelism(cores, opts.parallel, opts.threads or base_threads)
    todo = [r for r in runs if not (previous.get(r.slug, {}).get("status") in FINISHED
                                     and _complete(out / "runs" / r.slug, previous[r.slug]["status"]))]
    parallel = max(1, min(parallel, len(todo) or 1))
    (out / "runs").mkdir(exist_ok=True)

    entries = []
    for r in runs:
        prev = previous.get(r.slug, {})
        entries.append({
            "slug": r.slug, "name": r.name, "values": r.values, "overrides": r.set_args(),
            "command": _display(train_command(opts, r, threads, resume=False)),
            "status": prev.get("status", "pending"), "attempts": prev.get("attempts", 0),
            **{k: prev[k] for k in ("returncode", "error", "wall_s", "stage", "verdict") if k in prev},
        })
    doc = {
        "version": SWEEP_VERSION, "preset": opts.preset, "overrides": list(opts.overrides),
        "grid": opts.grid, "settings": opts.settings, "source": opts.source,
        "parallel": parallel, "threads_per_run": threads, "cores": cores,
        "probe": {"train_samples": opts.probe_train, "test_samples": opts.probe_test},
        "started": old.get("started") if previous else time.strftime("%Y-%m-%dT%H:%M:%S"),
        "resumed": time.strftime("%Y-%m-%dT%H:%M:%S") if previous else None, "runs": entries,
    }
    journal = _Journal(journal_path, doc)
    skipped = len(runs) - len(todo)
    log(f"sweep: {len(runs)} runs in {out} ({skipped} finished, skipped); {parallel} at once × "
        f"{threads} thread{'s' * (threads > 1)} ({cores} cores)")

    counter = {"n": 0}
    count_lock = threading.Lock()
    stop = threading.Event()  # set on Ctrl-C / SIGTERM: no new run starts
    children = _Children()

    def work(run: RunSpec):
        if stop.is_set():
            return
        status = _execute(opts, run, configs[run.slug], threads, journal, children, resume=opts.resume)
        if status == "interrupted":
            stop.set()
            return
        with count_lock:
            counter["n"] += 1
            n = counter["n"]
        e = journal.run(run.slug)
        extra = f": {e.get('error', '')}" if status != "done" else ""
        log(f"[{n}/{len(todo)}] {run.slug}: {status} in {e.get('wall_s', 0):.0f} s{extra}")

    import torch

    _preload_probe()  # import in this thread, not concurrently in the workers
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(threads)  # the in-process probes
    main_thread = threading.current_thread() is threading.main_thread()
    old_term = signal.signal(signal.SIGTERM, _raise_interrupt) if main_thread else None
    pool = ThreadPoolExecutor(max_workers=parallel)
    try:
        futures = [pool.submit(work, r) for r in todo]
        for f in futures:
            f.result()
    except KeyboardInterrupt:
        stop.set()
        children.terminate()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        if main_thread:
            signal.signal(signal.SIGTERM, old_term)
        torch.set_num_threads(torch_threads)
        doc["wall_s"] = time.perf_counter() - t0
        journal.write()
    if stop.is_set():
        raise KeyboardInterrupt

    rows = collect(out, runs, configs, journal)
    write_table(out, rows, runs, opts, doc)
    plot_curves(out / "curves.png", rows)
    doc["wall_s"] = time.perf_counter() - t0
    doc["outputs"] = {"table_md": "table.md", "table_csv": "table.csv", "curves": "curves.png"}
    journal.write()
    log(f"sweep: wrote {out / 'table.md'}, {out / 'table.csv'}, {out / 'curves.png'} ({doc['wall_s']:.0f} s)")
    return doc


def _preload_probe() -> None:
    import nclip.data.digits  # noqa: F401
    import nclip.data.synthetic  # noqa: F401
    import nclip.eval.features  # noqa: F401
    import nclip.eval.metrics  # noqa: F401
    import nclip.models.dual_encoder  # noqa: F401
    import nclip.models.io  # noqa: F401

    try:
        import nclip.eval.probe  # noqa: F401
    except ImportError:  # pragma: no cover
        pass


def _complete(run_dir: Path, status: str) -> bool:
    if status == "diverged":
        return True
    return (run_dir / "eval.json").is_file() and (run_dir / "probe.json").is_file()


def _execute(opts: SweepOptions, run: RunSpec, cfg, threads: int, journal: _Journal, children: _Children,
             resume: bool) -> str:
    """Train (unless trained) and probe one run; record its status. Never raises for a bad run."""
    rd = opts.out / "runs" / run.slug
    rd.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    attempts = journal.run(run.slug).get("attempts", 0) + 1
    journal.update(run.slug, status="running", attempts=attempts, started=time.strftime("%Y-%m-%dT%H:%M:%S"))
    env = _subprocess_env(threads)
    (rd / "error.txt").unlink(missing_ok=True)

    def fail(stage: str, rc: int, stderr_path: Path) -> str:
        tail = _tail(stderr_path)
        (rd / "error.txt").write_text(f"{stage} exited with status {rc}\n{tail}\n")
        verdict = judge(read_metrics(rd / "metrics.jsonl"), cfg, tail if stage == "train" else "")
        status = "diverged" if verdict["verdict"] == "diverged" else "failed"
        lines = [x for x in tail.splitlines() if x.strip()]
        journal.update(run.slug, status=status, stage=stage, returncode=rc, error=lines[-1] if lines else "",
                       wall_s=time.perf_counter() - t, verdict=verdict["verdict"])
        return status

    trained = (rd / "model" / "config.json").is_file() and (rd / "eval.json").is_file()
    if not trained:
        cmd = train_command(opts, run, threads, resume=resume and attempts > 1)
        journal.update(run.slug, command=_display(cmd))
        with open(rd / "stdout.txt", "w") as so, open(rd / "stderr.txt", "w") as se:
            rc = children.run(cmd, stdout=so, stderr=se, env=env, stdin=subprocess.DEVNULL)
        if rc in (130, -signal.SIGINT, -signal.SIGTERM):  # Ctrl-C reached the run too: stop the sweep
            journal.update(run.slug, status="interrupted", stage="train", returncode=rc, wall_s=time.perf_counter() - t)
            return "interrupted"
        if rc != 0:
            return fail("train", rc, rd / "stderr.txt")
    # the probe runs in this process (a thread of the pool): one interpreter start less per run
    try:
        result = probe_run(rd, opts.probe_train, opts.probe_test)
    except Exception as e:  # a bad run must not stop the sweep; keep the traceback for error.txt
        import traceback

        (rd / "probe.log").write_text(traceback.format_exc() + f"{type(e).__name__}: {e}\n")
        return fail("probe", 1, rd / "probe.log")
    tmp = rd / ".probe.json.tmp"
    tmp.write_text(json.dumps(jsonable(result, str), indent=2) + "\n")
    os.replace(tmp, rd / "probe.json")
    verdict = judge(read_metrics(rd / "metrics.jsonl"), cfg)
    journal.update(run.slug, status="done", stage="done", returncode=0, error="", wall_s=time.perf_counter() - t,
                   verdict=verdict["verdict"])
    return "done"


# ---------------------------------------------------------------------------------------------
# table and curves
# ---------------------------------------------------------------------------------------------

STATUS_TEXT = {"ok": "ok", "dimensional": "dimensional collapse", "uniform": "collapsed (uniform)",
               "one_hot": "collapsed (one-hot)", "diverged": "diverged"}


def collect(out: Path, runs: list[RunSpec], configs: dict, journal: _Journal | None = None) -> list[dict]:
    """One row per run: its values, ZS, LN, final terms, verdict and curves."""
    rows = []
    for run in runs:
        rd = out / "runs" / run.slug
        entry = journal.run(run.slug) if journal else {}
        cfg = configs[run.slug]
        metrics = read_metrics(rd / "metrics.jsonl")
        status = entry.get("status", "pending")
        stderr = _tail(rd / "error.txt") if status in ("failed", "diverged") else ""
        v = judge(metrics, cfg, stderr if entry.get("stage") == "train" else "")
        dataset, kind = _probe_dataset(cfg)
        zs = ln = math.nan
        if (rd / "eval.json").is_file():
            zs = float(json.loads((rd / "eval.json").read_text()).get(f"zeroshot/{kind}/top1", math.nan))
        if (rd / "probe.json").is_file():
            ln = float(json.loads((rd / "probe.json").read_text()).get("linear/top1", math.nan))
        if status == "done":
            state = STATUS_TEXT[v["verdict"]]
        elif status == "diverged" or v["verdict"] == "diverged":
            state = "diverged"
        else:
            state = status  # failed, pending, running (interrupted)
        bad = state not in ("ok", "dimensional collapse")
        rows.append({
            "slug": run.slug, "name": run.name, "values": run.values, "state": state,
            "zs_measured": zs, "ln_measured": ln,
            "zs": math.nan if bad else zs, "ln": math.nan if bad else ln,
            "final": v["final"], "collapse": v["collapse"], "nonfinite_steps": v["nonfinite_steps"],
            "wall_s": entry.get("wall_s"), "error": entry.get("error", ""), "metrics": metrics,
            "zs_key": f"zeroshot/{kind}/top1", "ln_data": f"{dataset}-{kind}", "k": cfg.model.nclip_dim,
            "stats_prefix": REGISTRY[cfg.objective.name][1].head_stats_prefix,
        })
    return rows


def _pct(x: float) -> str:
    return f"{100 * x:.1f}" if _finite(x) else "NaN"


def _num(x) -> str:
    return f"{x:.3f}" if _finite(x) else ("NaN" if x is not None else "–")


def _cell(row: dict, key: str) -> str:
    s = row["state"]
    if s.startswith("collapsed"):
        return "collapsed"
    if s != "diverged" and s not in ("ok", "dimensional collapse"):
        return s  # failed, pending, interrupted
    return _pct(row[key])


def write_table(out: Path, rows: list[dict], runs: list[RunSpec], opts: SweepOptions, doc: dict) -> None:
    """DIR/table.md (the layout of Tab. 9: varied keys, ZS, LN; plus the final L_KL/L_EH/L_HE
    and the verdict) and DIR/table.csv (the same, unrounded, with the measured numbers)."""
    keys = list(runs[0].values) if runs else []
    shorts = short_names(keys)
    named = any(r.name for r in runs)
    head = (["setting"] if named else []) + [field_title(k) or shorts[k] for k in keys] + \
        ["ZS", "LN", "L_KL", "L_EH", "L_HE", "status"]
    align = ([":--"] if named else []) + ["--:"] * (len(keys) + 5) + [":--"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    for r in rows:
        f = r["final"]
        cells = ([r["name"] or ""] if named else []) + [_fmt(r["values"].get(k)) for k in keys] + \
            [_cell(r, "zs"), _cell(r, "ln"), _num(f.get("L_KL")), _num(f.get("L_EH")), _num(f.get("L_HE")), r["state"]]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    ex = rows[0] if rows else {"zs_key": "zeroshot/shape/top1", "ln_data": "synthetic-shape"}
    over = " ".join(f"--set {shlex.quote(o)}" for o in opts.overrides)
    notes = [
        f"Sweep of `--preset {opts.preset}`{(' ' + over) if over else ''}: {len(rows)} runs "
        f"({doc.get('parallel')} at once × {doc.get('threads_per_run')} thread"
        f"{'s' * (doc.get('threads_per_run') != 1)} each).",
        "",
        *lines,
        "",
        f"ZS: zero-shot top-1 (%) of the objective's zero-shot head on held-out synthetic scenes "
        f"(`{ex['zs_key']}` of RUN/eval.json). LN: linear-probe top-1 (%) on frozen image-backbone features "
        f"({ex['ln_data']}, {opts.probe_train} train / {opts.probe_test} test held-out images, RUN/probe.json). "
        f"L_KL, L_EH, L_HE: last logged values (nats). NaN: diverged (non-finite loss); collapsed: "
        f"CollapseMonitor still reports uniform or one-hot collapse at the end of training "
        f"(measured numbers in table.csv).",
    ]
    (out / "table.md").write_text("\n".join(notes) + "\n")

    with open(out / "table.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["slug", "setting", *keys, "zs_top1", "ln_top1", "L_KL", "L_EH", "L_HE", "row_std", "col_std",
                    "usage", "status", "collapse", "nonfinite_steps", "zs_measured", "ln_measured", "wall_s", "error"])
        for r in rows:
            f = r["final"]
            w.writerow([r["slug"], r["name"] or "", *[_fmt(r["values"].get(k)) for k in keys],
                        _csvnum(100 * r["zs"]), _csvnum(100 * r["ln"]),
                        *[_csvnum(f.get(k)) for k in ("L_KL", "L_EH", "L_HE", "row_std", "col_std", "usage")],
                        r["state"], ";".join(r["collapse"]), r["nonfinite_steps"],
                        _csvnum(100 * r["zs_measured"]), _csvnum(100 * r["ln_measured"]),
                        _csvnum(r["wall_s"]), r["error"]])


def _csvnum(x) -> str:
    if x is None:
        return ""
    return "NaN" if not _finite(x) else f"{x:.6g}"


FIG_B1_PANELS = (("col_std", "(a) Column std"), ("row_std", "(b) Row std"), ("L_KL", "(c) L_KL"),
                 ("L_EH", "(d) L_EH"), ("L_HE", "(e) L_HE"))


def plot_curves(path: Path, rows: list[dict]) -> None:
    """Fig. B1 of the xCLIP appendix for every run: column std, row std, L_KL, L_EH, L_HE vs step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8), constrained_layout=True)
    flat = axes.ravel()
    handles = []
    for row in rows:
        metrics = row["metrics"]
        prefix = row["stats_prefix"]
        if prefix is None or not any(f"{prefix}/L_HE" in m for m in metrics):
            continue
        label = f"{row['name'] + ' ' if row['name'] else ''}" + \
            ", ".join(f"{k.rsplit('.', 1)[-1]}={_fmt(v)}" for k, v in row["values"].items() if not row["name"]) + \
            ("" if row["state"] == "ok" else f" [{row['state']}]")
        label = label.strip() or row["slug"]
        for ax, (key, _) in zip(flat, FIG_B1_PANELS):
            pts = [(m["step"], m.get(f"{prefix}/{key}")) for m in metrics]
            xs = [s for s, y in pts if y is not None]
            ys = [float(y) if _finite(y) else math.nan for _, y in pts if y is not None]
            (line,) = ax.plot(xs, ys, lw=1.2)
            if ax is flat[0]:
                handles.append((line, label))
    ks = {row["k"] for row in rows if row["stats_prefix"] and any(f"{row['stats_prefix']}/L_HE" in m
                                                                  for m in row["metrics"])}
    for ax, (key, title) in zip(flat, FIG_B1_PANELS):
        if key in ("L_EH", "L_HE") and len(ks) == 1:  # the uniform-collapse level of both entropies
            ax.axhline(math.log(next(iter(ks))), color="gray", ls="--", lw=0.8)
            ax.text(0.99, 0.98, "ln K", transform=ax.transAxes, ha="right", va="top", color="gray", fontsize=8)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    flat[5].axis("off")
    if handles:
        flat[5].legend([h for h, _ in handles], [lab for _, lab in handles], loc="center", fontsize=9, frameon=False)
    else:
        flat[5].text(0.5, 0.5, "no nCLIP-head terms logged", ha="center", va="center")
    fig.suptitle("nCLIP-head statistics over training (xCLIP Appendix Fig. B1)")
    fig.savefig(path, dpi=110)
    plt.close(fig)
