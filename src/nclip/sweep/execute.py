"""Running a sweep: one ``nclip train`` child process per run, ``N`` at once, each followed by its
probe; the journal DIR/sweep.json records every change of a run's status, so that ``--resume``
knows what is left; Ctrl-C or SIGTERM ends the children too."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from nclip.errors import NclipError
from nclip.jsonio import jsonable
from nclip.overwrite import SWEEP, check_output_folder
from nclip.runlock import LOCK_NAME, DirLock
from nclip.sweep.curves import plot_curves
from nclip.sweep.grid import RunSpec, expand, flatten
from nclip.sweep.options import SweepOptions
from nclip.sweep.probe import preload_probe, probe_run
from nclip.sweep.tables import collect, write_table
from nclip.sweep.verdicts import judge, read_metrics, stderr_tail

SWEEP_VERSION = 1
FINISHED = ("done", "diverged")  # skipped by --resume
SWEEP_JOURNAL = "sweep.json"
assert SWEEP.markers == (SWEEP_JOURNAL,)  # how nclip.overwrite tells a sweep's folder


# ---------------------------------------------------------------------------------------------
# plan
# ---------------------------------------------------------------------------------------------


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS / Windows
        return os.cpu_count() or 1


def plan_parallelism(cores: int, parallel: int | None, threads: int | None) -> tuple[int, int]:
    """(runs at once N, threads per run T): N = max(1, cores // T) with T = 1 unless given;
    with only N given, T = max(1, cores // N). ``parallel`` and ``threads`` are >= 1 when given
    (:class:`SweepOptions` checks the options)."""
    if threads is None:
        threads = max(1, cores // parallel) if parallel else 1
    if parallel is None:
        parallel = max(1, cores // threads)
    return parallel, threads


@dataclass
class _Plan:
    """How a sweep runs: ``parallel`` runs at once with ``threads`` threads each, and the runs left."""

    parallel: int
    threads: int
    cores: int
    todo: list[RunSpec]


def _plan(opts: SweepOptions, runs: list[RunSpec], previous: dict[str, dict]) -> _Plan:
    from nclip.config import resolve

    cores = available_cores()
    base_threads = resolve(opts.preset, list(opts.overrides)).train.threads  # a preset or --set may fix it
    base_threads = base_threads if isinstance(base_threads, int) else None  # auto: each run its share
    parallel, threads = plan_parallelism(cores, opts.parallel, opts.threads or base_threads)
    todo = [r for r in runs if not _finished(opts.out / "runs" / r.slug, previous.get(r.slug, {}))]
    return _Plan(parallel=max(1, min(parallel, len(todo) or 1)), threads=threads, cores=cores, todo=todo)


def _finished(run_dir: Path, entry: dict) -> bool:
    """A run that ``--resume`` skips: diverged, or done with its eval.json and probe.json in place."""
    status = entry.get("status")
    if status == "diverged":
        return True
    return status == "done" and (run_dir / "eval.json").is_file() and (run_dir / "probe.json").is_file()


# ---------------------------------------------------------------------------------------------
# the journal, the children, the train command
# ---------------------------------------------------------------------------------------------


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
    env = dict(os.environ)  # PYTHONPATH included: the children import the same nclip as the sweep
    env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    return env


def train_command(opts: SweepOptions, run: RunSpec, threads: int, resume: bool) -> list[str]:
    """The ``nclip train`` argv of one run (``python -m nclip`` of this interpreter)."""
    cmd = [sys.executable, "-m", "nclip", "train", "--preset", opts.preset, "--out",
           str(opts.out / "runs" / run.slug), "--no-progress"]
    sets = list(opts.overrides) + run.set_args()
    if "train.threads" not in flatten(run.assign):
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


# ---------------------------------------------------------------------------------------------
# the sweep
# ---------------------------------------------------------------------------------------------


def run_sweep(opts: SweepOptions, log: Callable[[str], None] = print) -> dict:
    """Run (or resume) a sweep; returns the sweep.json document. See :mod:`nclip.sweep`."""
    t0 = time.perf_counter()
    runs = expand(opts.grid, opts.settings)
    configs = {r.slug: _resolve(opts, r) for r in runs}  # every config is valid before anything runs
    if opts.force:  # beside other files, never over a run, a checkpoint or another command's output
        check_output_folder(opts.out, "--out", SWEEP)
    with DirLock(opts.out, "nclip sweep"):  # one writer: a second sweep, a training run or an eval is refused
        return _run_sweep(opts, runs, configs, log, t0)


def _run_sweep(opts: SweepOptions, runs: list[RunSpec], configs: dict, log: Callable[[str], None], t0: float) -> dict:
    """The sweep, under its lock: check what a resumed journal knew, plan, run what is left, then
    the table and the curves of every run."""
    old = _previous_journal(opts, runs)
    previous = {r["slug"]: r for r in old.get("runs", [])}
    plan = _plan(opts, runs, previous)
    (opts.out / "runs").mkdir(exist_ok=True)
    journal = _Journal(opts.out / SWEEP_JOURNAL, _journal_doc(opts, runs, old, previous, plan))
    log(f"sweep: {len(runs)} runs in {opts.out} ({len(runs) - len(plan.todo)} finished, skipped); "
        f"{plan.parallel} at once × {plan.threads} thread{'s' * (plan.threads > 1)} ({plan.cores} cores)")
    try:
        _run_all(opts, plan, configs, journal, log)
    finally:
        journal.doc["wall_s"] = time.perf_counter() - t0
        journal.write()
    return _write_outputs(opts, runs, configs, journal, log, t0)


def _previous_journal(opts: SweepOptions, runs: list[RunSpec]) -> dict:
    """The sweep.json of the sweep in ``opts.out`` ({} if there is none), checked for ``--resume``:
    a sweep continues only with the preset, the overrides and, for each run, the settings it was
    started with."""
    out, path = opts.out, opts.out / SWEEP_JOURNAL
    if not path.exists():
        if (out / "runs").is_dir() and any((out / "runs").iterdir()):
            raise NclipError(f"{out}/runs is not empty but has no sweep.json; choose another --out")
        held = sorted(p.name for p in out.iterdir() if p.name not in (LOCK_NAME, "runs"))
        if held and not opts.force:  # table.md, curves.png... would replace what another command left there
            raise NclipError(f"{out} holds other files ({held[0]}{', ...' if len(held) > 1 else ''}) and no sweep; "
                             "choose another --out, or pass --force to write the sweep beside them")
        return {}
    if not opts.resume:
        raise NclipError(f"{out} already holds a sweep (sweep.json): pass --resume to continue it, "
                         f"or choose another --out")
    try:
        old = json.loads(path.read_text())
    except ValueError:
        raise NclipError(f"{path} is not valid JSON") from None
    if old.get("preset") != opts.preset or old.get("overrides") != list(opts.overrides):
        raise NclipError(f"--resume: {path} was started with --preset {old.get('preset')} and "
                         f"--set {old.get('overrides')}; resume it with the same options")
    previous = {r["slug"]: r for r in old.get("runs", [])}
    for r in runs:
        if r.slug in previous and previous[r.slug].get("overrides") != r.set_args():
            raise NclipError(f"--resume: run {r.slug} was started with other overrides "
                             f"({previous[r.slug].get('overrides')}); use a new --out")
    return old


def _journal_doc(opts: SweepOptions, runs: list[RunSpec], old: dict, previous: dict[str, dict], plan: _Plan) -> dict:
    """sweep.json as the sweep starts: its options and plan, and every run with what the previous
    journal (``old``, when resuming) knew of it."""
    now = time.strftime("%Y-%m-%dT%H:%M:%S")
    entries = []
    for r in runs:
        prev = previous.get(r.slug, {})
        entries.append({
            "slug": r.slug, "name": r.name, "values": r.values, "overrides": r.set_args(),
            "command": _display(train_command(opts, r, plan.threads, resume=False)),
            "status": prev.get("status", "pending"), "attempts": prev.get("attempts", 0),
            **{k: prev[k] for k in ("returncode", "error", "wall_s", "stage", "verdict") if k in prev},
        })
    return {
        "version": SWEEP_VERSION, "preset": opts.preset, "overrides": list(opts.overrides),
        "grid": opts.grid, "settings": opts.settings, "source": opts.source,
        "parallel": plan.parallel, "threads_per_run": plan.threads, "cores": plan.cores,
        "probe": {"train_samples": opts.probe_train, "test_samples": opts.probe_test},
        "started": old.get("started") if previous else now, "resumed": now if previous else None, "runs": entries,
    }


def _run_all(opts: SweepOptions, plan: _Plan, configs: dict, journal: _Journal, log: Callable[[str], None]) -> None:
    """Train and probe the runs left, ``plan.parallel`` at once (each in a thread that waits on its
    child). Ctrl-C or SIGTERM, to the sweep or to a run, starts no new run, ends the children (they
    keep their last checkpoint) and raises KeyboardInterrupt."""
    import torch

    stop = threading.Event()
    children = _Children()
    count, count_lock = [0], threading.Lock()

    def work(run: RunSpec):
        if stop.is_set():
            return
        status = _execute(opts, run, configs[run.slug], plan.threads, journal, children)
        if status == "interrupted":
            stop.set()
            return
        with count_lock:
            count[0] += 1
            n = count[0]
        e = journal.run(run.slug)
        extra = f": {e.get('error', '')}" if status != "done" else ""
        log(f"[{n}/{len(plan.todo)}] {run.slug}: {status} in {e.get('wall_s', 0):.0f} s{extra}")

    preload_probe()
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(plan.threads)  # the in-process probes
    main_thread = threading.current_thread() is threading.main_thread()
    old_term = signal.signal(signal.SIGTERM, _raise_interrupt) if main_thread else None
    pool = ThreadPoolExecutor(max_workers=plan.parallel)
    try:
        for future in [pool.submit(work, r) for r in plan.todo]:
            future.result()
    except KeyboardInterrupt:
        stop.set()
        children.terminate()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        if main_thread:
            signal.signal(signal.SIGTERM, old_term)
        torch.set_num_threads(torch_threads)
    if stop.is_set():
        raise KeyboardInterrupt


def _write_outputs(opts: SweepOptions, runs: list[RunSpec], configs: dict, journal: _Journal,
                   log: Callable[[str], None], t0: float) -> dict:
    """DIR/table.md, DIR/table.csv and DIR/curves.png from every run's files; the final sweep.json."""
    out, doc = opts.out, journal.doc
    rows = collect(out, runs, configs, journal)
    write_table(out, rows, runs, opts, doc)
    plot_curves(out / "curves.png", rows)
    doc["wall_s"] = time.perf_counter() - t0
    doc["outputs"] = {"table_md": "table.md", "table_csv": "table.csv", "curves": "curves.png"}
    journal.write()
    log(f"sweep: wrote {out / 'table.md'}, {out / 'table.csv'}, {out / 'curves.png'} ({doc['wall_s']:.0f} s)")
    return doc


# ---------------------------------------------------------------------------------------------
# one run
# ---------------------------------------------------------------------------------------------


def _execute(opts: SweepOptions, run: RunSpec, cfg, threads: int, journal: _Journal, children: _Children) -> str:
    """Train (unless trained) and probe one run; record its status. Never raises for a bad run."""
    rd = opts.out / "runs" / run.slug
    rd.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    attempts = journal.run(run.slug).get("attempts", 0) + 1
    journal.update(run.slug, status="running", attempts=attempts, started=time.strftime("%Y-%m-%dT%H:%M:%S"))
    (rd / "error.txt").unlink(missing_ok=True)

    def fail(stage: str, rc: int, stderr_path: Path) -> str:
        tail = stderr_tail(stderr_path)
        (rd / "error.txt").write_text(f"{stage} exited with status {rc}\n{tail}\n")
        verdict = judge(read_metrics(rd / "metrics.jsonl"), cfg, tail if stage == "train" else "")
        status = "diverged" if verdict["verdict"] == "diverged" else "failed"
        lines = [x for x in tail.splitlines() if x.strip()]
        journal.update(run.slug, status=status, stage=stage, returncode=rc, error=lines[-1] if lines else "",
                       wall_s=time.perf_counter() - t, verdict=verdict["verdict"])
        return status

    trained = (rd / "model" / "config.json").is_file() and (rd / "eval.json").is_file()
    if not trained:
        cmd = train_command(opts, run, threads, resume=opts.resume and attempts > 1)
        journal.update(run.slug, command=_display(cmd))
        with open(rd / "stdout.txt", "w") as so, open(rd / "stderr.txt", "w") as se:
            rc = children.run(cmd, stdout=so, stderr=se, env=_subprocess_env(threads), stdin=subprocess.DEVNULL)
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
