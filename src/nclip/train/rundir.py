"""The run directory's rules: no command destroys a run (docs/runs.md).

- ``nclip train --out R`` into a directory that already holds a run is refused; ``--force``
  starts over, removing the trainer's files of the old run first (never other files).
- ``--resume auto`` continues a run only with the config it was started with, up to the keys in
  :data:`RESUME_MAY_CHANGE`; changes of those are written to ``config.yaml``.
- ``--extend-to N`` trains a run beyond its ``train.steps``: the lr follows the run's own
  schedule to its end and then stays at ``train.min_lr`` (``train.schedule_steps``).

Under torchrun rank 0 reads the directory and decides, and every rank gets its decision (the same
plan, or the same error) before any rank writes: :func:`agree`.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from nclip.config import RunConfig, to_yaml, validate
from nclip.errors import NclipError
from nclip.jsonio import check_writable_dir, parse_yaml, read_text, write_text_atomic
from nclip.overwrite import EXPORT, RUN_FILES, check_output_folder
from nclip.runlock import LOCK_NAME, DirLock

CONFIG = "config.yaml"
EPISODES_LOG = "episodes.jsonl"  # ProtoCLIP's per-episode log (nclip.train.episodic)
# Everything the trainer writes into a run directory (any of them marks a run), in the order --force
# removes them; nclip.overwrite keeps the list, so that no other command writes over them
assert CONFIG in RUN_FILES and EPISODES_LOG in RUN_FILES
LEFTOVERS = (".model.*", f".{CONFIG}.*")  # temporaries of interrupted atomic writes beside them

# Keys that --resume auto may change. None of them changes what a step computes (the samples, their
# order, the weights, the lr): they set how often the run logs and checkpoints, when it gives up,
# how many threads compute it and how it is evaluated at the end. Every other change is an error.
RESUME_MAY_CHANGE = (
    "train.log_every",  # metrics.jsonl lines only
    "train.checkpoint_every",  # writing a checkpoint reads the state, it changes none of it
    "train.keep_checkpoints",
    "train.threads",  # the same math; float rounding may differ, as it would on another machine
    "train.compile",  # the same math, compiled; float rounding may differ (fused kernels)
    "model.grad_checkpointing",  # the same ops, some run again in the backward: the same numbers
    "train.max_nonfinite_steps",  # when to stop on non-finite steps, not what a step does
    "train.memory_check",  # a check before the first step; it leaves the run as it found it
    "train.tensorboard", "train.report_to",  # copies of metrics.jsonl's scalars
    "data.max_bad_fraction", "data.bad_window",  # when to stop on bad samples, not which are skipped
    "data.num_workers",  # map-style sources: a sample is a pure function of (seed, index)...
    "objective.ext_cache_dir",  # where ProtoCLIP's teacher features are cached (keyed by identity)
    "eval.*",  # the end-of-run evaluation only
    "train.eval_every", "train.eval_datasets", "train.eval_samples",  # evaluation while training reads the model only
)
# ...but a WebDataset run has one shard stream per loader worker, so there the count sets the order
STREAM_ORDER_KEYS = ("data.num_workers",)


@dataclass(frozen=True)
class RunPlan:
    """What ``train`` does to the run directory once every rank agrees on it."""

    cfg: RunConfig  # the config to train with (an extension's steps applied)
    clear: tuple[str, ...] = ()  # trainer files of an old run to remove first (--force)
    note: str | None = None  # one line for stderr (rank 0) when the run starts


@dataclass(frozen=True)
class RunInfo:
    """A run as every phase of training sees it, fixed from its restore to its finish."""

    cfg: RunConfig  # the config it trains with (the plan's)
    run_dir: Path
    ctx: object  # this process's nclip.train.launch.DistContext: rank, world size, device
    start: int = 0  # the step to continue from (0 for a new run)
    save: bool = True  # False: no checkpoint, model/ or eval.json (train(save=False))


def plan_run(cfg: RunConfig, run_dir: Path, resume: bool, force: bool, extend_to: int | None,
             lock: DirLock | None = None) -> RunPlan:
    """Check ``run_dir`` against the request, reading only; raise a one-line NclipError if it
    would destroy or mix runs. ``extend_to`` implies ``resume``. ``lock`` (held until the run
    ends) is taken first, so that what is read here stays true until this process writes."""
    resume = resume or extend_to is not None
    _check_request(run_dir, resume, force)
    if lock is not None:
        lock.acquire()
    found = run_files(run_dir)
    if force:
        return RunPlan(cfg, clear=found, note=_force_note(run_dir, found) if found else None)
    if found and not has_completed_step(run_dir) and _trainer_wrote(run_dir / CONFIG):  # a start-up's leftovers
        if extend_to is not None:
            raise NclipError(f"--extend-to: {run_dir} holds no run to extend (no completed step)")
        return RunPlan(cfg, clear=found, note=f"{run_dir} holds no completed step (only the {', '.join(found)} of a "
                       "run stopped before its first step): starting afresh in it")
    if not found:
        if extend_to is not None:
            raise NclipError(f"--extend-to: {run_dir} holds no run to extend")
        return RunPlan(cfg)
    if not resume:
        raise NclipError(f"{run_dir} already holds a run ({', '.join(found)}): continue it with --resume auto, "
                         "train into a new --out, or start over with --force")
    return _resume_plan(cfg, run_dir, saved_config(run_dir, found), extend_to)


def _check_request(run_dir: Path, resume: bool, force: bool) -> None:
    if force and resume:
        raise NclipError("--force starts the run over; it cannot be combined with --resume auto or --extend-to")
    if run_dir.exists() and not run_dir.is_dir():
        raise NclipError(f"--out {run_dir} is a file, not a run directory")
    check_writable_dir(run_dir, "--out")


def _resume_plan(cfg: RunConfig, run_dir: Path, saved: RunConfig, extend_to: int | None) -> RunPlan:
    """Continue the run in ``run_dir`` (saved config ``saved``), extended to ``extend_to`` steps."""
    if extend_to is not None:  # the extension sets the steps: compare the rest
        cfg = _with_steps(cfg, saved.train.steps, saved.train.schedule_steps)
    check_same_config(saved, cfg, run_dir)
    if extend_to is None or extend_to == saved.train.steps:
        return RunPlan(cfg)
    return _extension(cfg, saved, extend_to, run_dir)


def run_files(run_dir: Path) -> tuple[str, ...]:
    """The trainer's files present in ``run_dir`` (none: it holds no run)."""
    return tuple(name for name in RUN_FILES if (run_dir / name).exists())


def has_completed_step(run_dir: Path) -> bool:
    """Whether ``run_dir`` shows that a step was completed: a ``model/`` or ``eval.json``; a
    ``checkpoints/`` entry other than the dot-named temporaries of an interrupted write (a damaged
    checkpoint counts); a ``metrics.jsonl`` or ``episodes.jsonl`` with anything but whitespace in
    it (rows are written only after steps). Whatever cannot be read counts as a step. A directory
    without any of these holds only a start-up's ``config.yaml`` and empty logs: no run."""
    if (run_dir / "model").exists() or (run_dir / "eval.json").exists():
        return True
    try:
        checkpoints = run_dir / "checkpoints"
        if checkpoints.exists() and (not checkpoints.is_dir()
                                     or any(not p.name.startswith(".") for p in checkpoints.iterdir())):
            return True
        return any(log.exists() and (not log.is_file() or log.read_bytes().strip())
                   for log in (run_dir / "metrics.jsonl", run_dir / EPISODES_LOG))
    except OSError:
        return True


def _trainer_wrote(path: Path) -> bool:
    """Whether ``path`` is absent or byte for byte the config.yaml the trainer writes (so that a
    config file of the user's own, kept in the run directory, is never taken for a leftover)."""
    if not path.exists():
        return True
    try:
        text = path.read_text(encoding="utf-8")
        return to_yaml(validate(yaml.safe_load(text))) == text
    except Exception:  # noqa: BLE001 - unreadable, not YAML, not a config: not the trainer's
        return False


def saved_config(run_dir: Path, found: tuple[str, ...]) -> RunConfig:
    """The config a run was started with, from its config.yaml."""
    path = run_dir / CONFIG
    if not path.is_file():
        raise NclipError(f"{run_dir} holds a run ({', '.join(found)}) but no {CONFIG}, so --resume auto cannot "
                         "check that it continues with the same config; start over with --force or use a new --out")
    raw = parse_yaml(path, read_text(path, CONFIG)[1])  # a YAML mistake names its line and column
    if not isinstance(raw, dict):
        raise NclipError(f"{path} is not a config (the top level must be a mapping)")
    try:
        return validate(raw)
    except NclipError as e:
        raise NclipError(f"{path}: {e}") from None


def may_change_on_resume(key: str, saved: RunConfig) -> bool:
    if key in STREAM_ORDER_KEYS and saved.data.source == "webdataset":
        return False
    return any(key == k or (k.endswith(".*") and key.startswith(k[:-1])) for k in RESUME_MAY_CHANGE)


def config_differences(old: RunConfig, new: RunConfig) -> list[tuple[str, object, object]]:
    """(dotted key, old value, new value) of every leaf that differs, in the config's order."""
    a, b = _flatten(old.model_dump(mode="json")), _flatten(new.model_dump(mode="json"))
    keys = list(a) + [k for k in b if k not in a]
    return [(k, a.get(k, _ABSENT), b.get(k, _ABSENT)) for k in keys if a.get(k, _ABSENT) != b.get(k, _ABSENT)]


def check_same_config(saved: RunConfig, cfg: RunConfig, run_dir: Path) -> None:
    """Raise a one-line NclipError naming every key that differs and may not change on resume."""
    diffs = [d for d in config_differences(saved, cfg) if not may_change_on_resume(d[0], saved)]
    if not diffs:
        return
    shown = ", ".join(f"{k}: {_show(old)} -> {_show(new)}" for k, old, new in diffs[:6])
    more = f" and {len(diffs) - 6} more" if len(diffs) > 6 else ""
    old_steps, new_steps = saved.train.steps, cfg.train.steps
    hint = (f"; to train it beyond {old_steps} steps use --extend-to {new_steps} instead"
            if any(k == "train.steps" for k, _, _ in diffs) and new_steps > old_steps else "")
    raise NclipError(f"cannot resume {run_dir} with another config ({shown}{more}){hint}; only "
                     f"{', '.join(RESUME_MAY_CHANGE)} may change on resume (docs/runs.md); "
                     "train into a new --out to change the rest")


def agree(ctx, decide: Callable[[], RunPlan]) -> RunPlan:
    """Rank 0's ``decide()`` on every rank: its plan, or its error raised on every rank, so that
    all ranks take the same decision before any of them writes."""
    plan, error, failure = None, None, None
    if ctx.is_main:
        try:
            plan = decide()
        except Exception as e:  # noqa: BLE001 - the other ranks must hear of any failure
            failure, error = e, str(e)
    if ctx.distributed:
        import torch.distributed as dist

        box = [plan, error]
        dist.broadcast_object_list(box, src=0)
        plan, error = box
    if failure is not None:
        raise failure
    if error is not None:
        raise NclipError(error)
    return plan


def start_run(plan: RunPlan, run_dir: Path) -> None:
    """Rank 0, once the run is about to start: clear an old run (--force), write config.yaml
    (atomically; only if it changed) and say what happened."""
    for name in plan.clear:
        _remove(run_dir / name)
    for pattern in LEFTOVERS if plan.clear else ():
        for path in run_dir.glob(pattern):
            _remove(path)
    run_dir.mkdir(parents=True, exist_ok=True)
    text = to_yaml(plan.cfg)
    path = run_dir / CONFIG
    if not path.is_file() or path.read_text() != text:
        write_text_atomic(path, text)
    if plan.note:
        print(f"nclip: {plan.note}", file=sys.stderr, flush=True)


def _extension(cfg: RunConfig, saved: RunConfig, extend_to: int, run_dir: Path) -> RunPlan:
    old = saved.train.steps
    if extend_to < old:
        raise NclipError(f"--extend-to {extend_to} is below the {old} steps of {run_dir}; a run cannot be shortened")
    schedule = saved.train.schedule_steps or old
    note = (f"extending {run_dir} from {old} to {extend_to} steps: the lr follows the run's {schedule}-step "
            f"schedule (warm-up, cosine), then stays at train.min_lr {saved.train.min_lr:g}")
    return RunPlan(_with_steps(cfg, extend_to, schedule), note=note)


def _with_steps(cfg: RunConfig, steps: int, schedule_steps: int | None) -> RunConfig:
    raw = cfg.model_dump(mode="json")
    raw["train"].update(steps=steps, schedule_steps=schedule_steps)
    return validate(raw)


def _force_note(run_dir: Path, found: tuple[str, ...]) -> str:
    names = ", ".join(f"{n}/" if (run_dir / n).is_dir() else n for n in found)
    return f"--force: starting {run_dir} over; removed the old run's {names}"


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


_ABSENT = "(absent)"


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _show(value) -> str:
    return value if value is _ABSENT else json.dumps(value)


def check_export_target(source: Path, out: Path, force: bool, option: str = "--hf") -> None:
    """Refuse an ``out`` that would overwrite the model being exported, a run, a checkpoint or another
    command's output (even with ``force``: :func:`nclip.overwrite.check_output_folder`), and a
    non-empty ``out`` unless ``force``. ``option`` names ``out`` in the errors."""
    out, source = Path(out), Path(source)
    if out.exists() and not out.is_dir():
        raise NclipError(f"{option} {out} is a file, not a directory")
    check_output_folder(out, option, EXPORT)
    if out.resolve() == source.resolve():
        raise NclipError(f"{option} {out} is the model being exported; export to a new directory")
    if out.is_dir() and any(p.name != LOCK_NAME for p in out.iterdir()) and not force:
        raise NclipError(f"{option} {out} already exists and is not empty; choose a new directory, "
                         "or pass --force to write over it")
