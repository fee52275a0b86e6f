"""What a checkpoint keeps of a running run besides its weights, and how each rank gets it back.

:func:`save_run_state` writes a checkpoint of a step: the model's weights, the objective's state,
the optimizer, every rank's RNG states and data position, the loop's counters, the EMA and fp16's
loss scale (:mod:`nclip.train.checkpoint` writes the files). :func:`find_resume_point` picks the
newest readable checkpoint on rank 0 for every rank, and :func:`data_state_for_rank` gives each rank
its saved data position back, also after a change of world size.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from nclip.train.checkpoint import checkpoint_dir, newest_good_checkpoint, read_checkpoint, rng_state, save_checkpoint
from nclip.train.ema import ema_state
from nclip.train.launch import DistContext, full_state_dict, optimizer_state
from nclip.train.resume_fit import plugin_source_state
from nclip.train.rundir import RunInfo
from nclip.train.step import Learner


def save_run_state(info: RunInfo, learner: Learner, data, counters: dict[str, int], step: int) -> None:
    """A checkpoint of ``step``: collectives on every rank, written by rank 0."""
    ctx = info.ctx
    full = full_state_dict(learner.module)  # collectives under FSDP: every rank takes part
    fmt, opt_state = optimizer_state(learner.module, learner.optimizer)
    local = {"rng": rng_state(), "data": data.state()}
    if ctx.distributed:
        everyone: list = [None] * ctx.world_size
        dist.all_gather_object(everyone, local)
    else:
        everyone = [local]
    if not ctx.is_main:
        return
    state = {
        "optimizer_format": fmt,
        "optimizer": opt_state,
        "objective": strip_prefix(full, "objective."),
        "rng": [e["rng"] for e in everyone],
        "data": [e["data"] for e in everyone],
        "world_size": ctx.world_size, **plugin_source_state(info.cfg),  # a plugin's file, compared on resume
        "counters": dict(counters),
        **ema_state(learner.ema), **learner.gate.checkpoint_state(),  # the EMA; fp16's loss scale
    }
    save_checkpoint(info.run_dir, step, strip_prefix(full, "model."), state, info.cfg.train.keep_checkpoints)


def find_resume_point(run_dir: Path, ctx: DistContext) -> tuple[int, dict | None, dict | None]:
    """(step, weights, state) of the newest readable checkpoint, chosen on rank 0 for all ranks
    (every rank then reads the same directory: run dirs must be on a shared filesystem)."""
    step = -1
    if ctx.is_main:
        found = newest_good_checkpoint(run_dir)
        if found is not None:
            path, weights, state = found
            step = int(state["step"])
    if ctx.distributed:
        box = [step]
        dist.broadcast_object_list(box, src=0)
        step = int(box[0])
        if step >= 0 and not ctx.is_main:
            weights, state = read_checkpoint(checkpoint_dir(run_dir, step))
    if step < 0:
        return 0, None, None
    return step, weights, state


def data_state_for_rank(states: list, ctx: DistContext) -> dict | None:
    """This rank's saved data position; after a world-size change, only the bad-sample count
    survives (on rank 0) and streamed sources are re-seeded."""
    if len(states) == ctx.world_size:
        return states[ctx.rank]
    if not states or not ctx.is_main:
        return None
    kind = states[0].get("kind")
    if kind == "map":
        return {"kind": "map", "skipped": sum(int(s.get("skipped", 0)) for s in states)}
    total = sum(int(k) for s in states for _, k in s.get("streams", []))
    return {"kind": "stream", "world_size": -1, "streams": [[0, total]]}


def strip_prefix(state: dict, prefix: str) -> dict:
    """The entries of ``state`` under ``prefix``, keyed without it."""
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
