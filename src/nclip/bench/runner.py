"""``nclip bench``: nclip's speed and memory as ratios measured in one run (docs/performance.md).

Rows (every figure is measured in this run; a ratio's two sides are measured side by side):

- xCLIP over CLIP: step time and peak memory, each objective in its own subprocess (one per
  objective: build, warm-up and every repeat; :mod:`nclip.bench.objective_cost`);
- LoRA over full training: CLIP's step time and peak memory with ``model.lora`` (the run's, else
  rank 8 on the default targets, :mod:`nclip.models.lora`) over those of the same model trained
  whole (the CLIP row's), the LoRA step in a subprocess of its own;
- trainer over hand loop: the real training loop's speed as a share of a minimal hand-written
  loop's, each built once, their windows alternating in this process (:mod:`nclip.bench.loop_overhead`);
- MFU: the FLOPs of one training step (``FlopCounterMode``) per trainer step time, over the
  device's peak (a datasheet figure for known GPUs, else a measured matmul peak: float32 on the CPU);
- the ``nclip train`` path over the hand loop: the trainer with its real data loader
  (:mod:`nclip.bench.train_path`);
- synthetic data generation per core at 64 and 224 px, over the 2,000 samples/s target;
- ProtoCLIP's per-episode K-Means and PBT (the paper's 200k × 128 → 20k on a GPU; scaled down on
  the CPU, as the row says);
- evaluation feature extraction, images/s (the held-out scenes made by a process pool first), and
  ``nclip embed``'s images/s over the bare ``encode_image`` (:mod:`nclip.bench.embed_rate`);
- the largest global batch under a memory limit, plain, with gradient checkpointing and with exact
  accumulation: a linear fit of the peak memory of measured trainer steps (:mod:`nclip.bench.batch_memory`);
- trainer samples/s at FLIP patch dropout 0, 0.5 and 0.75 and the ratios to 0, ViT towers only
  (:mod:`nclip.bench.patch_dropout_rate`);
- with ``--compare open_clip``: nclip's CLIP trainer step over OpenCLIP's ViT-B/16 step, where
  ``open_clip`` imports (:mod:`nclip.bench.open_clip_step`).

The rows are grouped in stages (:data:`~nclip.bench.stages.STAGES`: a stage is a function that adds
its rows, and the names of those rows for when it is skipped); each records its wall time, its estimate and the
models it built and copied, and a stage that does not fit in what is left of ``--budget-s`` is
skipped with a stated reason (:mod:`nclip.bench.budget`, which also holds the estimate of what the
GPU sizes cost at ViT-B/16). A new row: one function and one line in :mod:`nclip.bench.stages`.

The bench writes no model: every training run in it is ``train(save=False)`` (only its config.yaml
and metrics.jsonl, in a temporary directory), and each model is built once in each process
(:mod:`nclip.bench.shared_models`; the rows get copies). The JSON counts both: ``models`` (builds
and copies, subprocesses included) and ``written_bytes`` (everything passed to ``write()``).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from nclip.bench.budget import DEFAULT_BUDGET_S, Budget, Sizes
from nclip.bench.context import Bench, OutOfBudget, Stage
from nclip.bench.shared_models import shared_models
from nclip.bench.stages import COMPARE, STAGES
from nclip.errors import NclipError


def _run_stage(b: Bench, stage: Stage) -> dict:
    """Run one stage within the budget; its rows get its wall time. Returns its record for the JSON:
    its wall time, its estimate, and the models it built and copied (here and in its subprocesses)."""
    first = len(b.rep.rows)
    t0 = time.perf_counter()
    before = {k: b.models.counts()[k] + b.child_models[k] for k in b.child_models}
    estimate = stage.estimate(b)
    reason = b.budget.why_not(estimate)
    if reason is None:
        b.log(f"bench: {stage.name} ({b.budget.spent():.0f} s so far)")
        try:
            stage.run(b)
        except OutOfBudget as e:
            del b.rep.rows[first:]
            reason = str(e)
    if reason is not None:
        for what in stage.rows:
            b.rep.skip(what, reason)
        b.log(f"bench: {stage.name}: {reason}")
    wall = time.perf_counter() - t0
    for row in b.rep.rows[first:]:
        row.wall_s = wall
    models = {k: b.models.counts()[k] + b.child_models[k] - before[k] for k in before}
    return {"stage": stage.name, "wall_s": wall, "estimate_s": estimate, **models,
            "rows": [r.what for r in b.rep.rows[first:]], "skipped": reason}


def run_bench(preset: str, overrides: list[str], quick: bool = False, compare: list[str] | None = None,
              log=lambda msg: None, budget_s: float | None = DEFAULT_BUDGET_S, memory_gib: float | None = None) -> dict:
    """Every row (module docstring) within ``budget_s`` wall seconds (None or 0: no limit); returns
    the JSON document (``table`` holds the printed table). ``memory_gib``: the largest-batch rows'
    limit (default: a GPU's free memory, 8 GiB on the CPU)."""
    budget = Budget(budget_s)
    for name in compare or []:
        if name not in COMPARE:
            raise NclipError(f"bench: --compare {name!r} is not known; use {', '.join(COMPARE)}")
    import torch

    from nclip.bench import loop_overhead
    from nclip.config import resolve

    cfg = resolve(preset, overrides)
    device = loop_overhead.device_of(cfg)
    if device.type == "cpu" and not isinstance(cfg.train.threads, int):
        # one intra-op thread unless asked: on a shared CPU two OpenMP threads spend most of a small
        # step waiting for each other (measured: a micro step 25 ms on 1 thread, 90-1000 ms on 2)
        overrides = [*overrides, "train.threads=1"]
        cfg = resolve(preset, overrides)
        log("bench: CPU: train.threads=1 (set train.threads to change)")
    if isinstance(cfg.train.threads, int):
        torch.set_num_threads(cfg.train.threads)
    written = _written_bytes()
    stages = [*STAGES, *(COMPARE[name] for name in compare or [])]
    with shared_models() as models:  # each model built once (nclip.bench.shared_models)
        b = Bench(preset, overrides, cfg, device, Sizes.pick(quick, device.type == "cuda"), budget, log,
                   memory_gib=memory_gib, models=models)
        records = [_run_stage(b, stage) for stage in stages]
        b.hand = None  # the trainer row's hand loop, where the train-path row did not run
    skipped = [r for r in records if r["skipped"]]
    if skipped:
        log("bench: skipped: " + "; ".join(f"{', '.join(r['rows'])} ({r['skipped']})" for r in skipped))

    threads = torch.get_num_threads()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    doc = {
        "device": name or f"cpu ({threads} thread{'s' * (threads != 1)})",
        "preset": preset, "overrides": overrides, "quick": quick,
        "budget_s": budget_s or None, "wall_s": budget.spent(),
        "models": {k: models.counts()[k] + b.child_models[k] for k in b.child_models},
        "written_bytes": None if written is None else _written_bytes() - written,
        **{k: b.headline.get(k) for k in ("trainer_over_hand_loop", "xclip_over_clip_time", "xclip_over_clip_memory",
                                          "lora_over_full_time", "lora_over_full_memory", "mfu",
                                          "train_path_over_hand_loop")},
        "details": {**b.details, "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None},
        "stages": records,
        "skipped": [{"stage": r["stage"], "rows": r["rows"], "reason": r["skipped"]} for r in skipped],
    }
    if "open_clip" in (compare or []):
        doc["open_clip"] = b.details.get("open_clip")
        doc["nclip_over_open_clip"] = b.headline.get("nclip_over_open_clip")
    doc["rows"] = [{"row": r.what, "value": r.value, "detail": r.detail, "wall_s": r.wall_s} for r in b.rep.rows]
    doc["table"] = b.rep.table()
    return doc


def _written_bytes() -> int | None:
    """Bytes this process and its finished subprocesses have passed to ``write()`` (Linux's
    /proc/self/io ``wchar``: files, and pipes and the terminal too), or None where there is no such file."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))
    except (OSError, StopIteration, ValueError):
        return None


def check_finite(doc: dict) -> None:
    """A sanity check for tests and CI: the headline ratios are positive finite numbers."""
    for key in ("trainer_over_hand_loop", "xclip_over_clip_time", "xclip_over_clip_memory", "mfu"):
        v = doc[key]
        if not (isinstance(v, float) and math.isfinite(v) and v > 0):
            raise AssertionError(f"{key} = {v!r}")


def write_json(doc: dict, path: Path) -> None:
    try:
        Path(path).write_text(json.dumps(doc, indent=2) + "\n")
    except OSError as e:
        raise NclipError(f"bench: cannot write {path}: {e.strerror}") from None
