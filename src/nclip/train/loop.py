"""The training loop: config → data + model → objective → optimizer steps → checkpoints → eval.

The loop never knows which objective it runs: it gets a loss and a dict of named terms, logs
them, and steps. One optimizer step consumes one global batch (``train.batch_size`` pairs), split
over the ranks and, on each rank, into ``train.accumulation`` micro-batches. By default
(``train.accumulation_mode: exact``) the objective is still that of the whole global batch: the
towers run micro-batch by micro-batch, the heads and the objective once on the whole batch
(:mod:`nclip.train.accumulate`); with ``independent`` each micro-batch is its own contrastive batch
(gathered over the ranks when the objective uses the global batch).

Distributed (``torchrun``, see docs/distributed.md and :mod:`nclip.train.launch`): every rank runs this
loop on its slice of every global batch; DDP or FSDP2 average the gradients; the logged terms are
means over ranks (no-grad all-reduce, so metrics.jsonl shows global values); rank 0 alone writes
logs, checkpoints, the final model and the evaluation.

Faults: a step whose loss or gradient is not finite on any rank is skipped on every rank (weights,
optimizer and buffers such as BatchNorm statistics untouched) and counted; after
``train.max_nonfinite_steps`` in a row the run stops with an :class:`NclipError` at the next log
step, keeping the last good checkpoint (none is written during such a streak). Bad data samples
are skipped by the data layer and counted (``data/skipped``).

One step is :func:`nclip.train.step.optimizer_step` (the model-plus-objective module and the update);
a checkpoint's state is :mod:`nclip.train.run_state`'s.

No host round trip on a step that logs nothing: the skip decision, the gradient norm and the
logged terms stay on the device (:mod:`nclip.train.gate`) and are read at log and checkpoint
steps only, so the host can queue the next step while the device runs this one.

Exact resume: a checkpoint holds the weights, the optimizer, the step (schedule and data position),
every rank's RNG states and data position, and the loop's counters, so a run killed at any point
(SIGKILL included) and resumed with ``--resume auto`` writes the same metrics.jsonl as a run never
interrupted (bitwise on CPU, wall-clock fields aside).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from nclip.batch import Batch
from nclip.config import RunConfig
from nclip.data.device_feed import DeviceFeed
from nclip.data.labels import label_space_for
from nclip.data.loader import train_loader
from nclip.defaults import BUILTIN_SOURCES
from nclip.errors import NclipError, source_named
from nclip.jsonio import WriteFailed, truncate_jsonl, writing
from nclip.models import build_model
from nclip.models.hf_import import init_config, load_init_weights
from nclip.models.locking import lock_towers
from nclip.objectives import build_objective, plan_for
from nclip.objectives.contract import FirstStepCheck
from nclip.precision import autocast_dtype
from nclip.runlock import DirLock
from nclip.train.accumulate import online_towers
from nclip.train.checkpoint import checkpoint_dir, kept_note, set_rng_state
from nclip.train.compile import compile_step
from nclip.train.ema import ema_for, evaluate_with_ema, save_run_models
from nclip.train.launch import (
    DistContext,
    cached_accumulation,
    full_state_dict,
    is_fsdp,
    load_optimizer_state,
    setup,
    teardown,
    wrap,
)
from nclip.train.logbook import METRICS, Log, startup_block
from nclip.train.memory_check import check_step_memory, out_of_memory_message
from nclip.train.monitors import nonfinite_stop
from nclip.train.optim import build_optimizer
from nclip.train.periodic_eval import PeriodicEval
from nclip.train.resume_fit import restore_weights
from nclip.train.run_state import data_state_for_rank, find_resume_point, save_run_state, strip_prefix
from nclip.train.rundir import RunInfo, agree, plan_run, start_run
from nclip.train.snapshot import BufferSnapshot
from nclip.train.step import Learner, StepResult, TrainStep, optimizer_step, wrap_passes
from nclip.train.threads import set_threads


@dataclass
class RunResult:
    run_dir: Path
    steps: int
    metrics: dict = field(default_factory=dict)  # last logged metrics (rank 0)
    eval: dict = field(default_factory=dict)
    already_finished: bool = False  # resumed a run that had reached its steps: nothing was done


def train(cfg: RunConfig, run_dir: str | Path, resume: bool = False, progress: bool = True,
          evaluate: bool = True, data_source=None, force: bool = False, extend_to: int | None = None,
          preset: str | None = None, save: bool = True) -> RunResult:
    """Train per ``cfg`` into ``run_dir``; under torchrun on every rank (see the module docstring).

    The run directory's rules (:mod:`nclip.train.rundir`, docs/runs.md): a directory that holds a
    run is refused unless ``resume`` (same config, up to a few keys) or ``force`` (start over);
    ``extend_to`` (implies ``resume``) trains a run beyond its ``train.steps``. Resuming a run that
    has reached its steps returns ``already_finished`` and touches nothing.

    ``data_source``: builds the batches instead of :func:`train_loader` (see ``_open_data``); episodic
    objectives (``Objective.episodic``, e.g. ProtoCLIP) get :class:`nclip.train.episodic.EpisodicData`.
    ``preset``: what the config was resolved from, for the start-up block (:mod:`nclip.train.logbook`).
    ``save=False`` (``nclip bench``): no checkpoint, model/ or eval.json (config.yaml, metrics.jsonl still).
    """
    if data_source is None and plan_for(cfg).episodic:
        from nclip.train.episodic import EpisodicData

        data_source = EpisodicData
    ctx = setup(cfg)
    lock = DirLock(run_dir, "nclip train")  # rank 0's, taken before it reads the directory (runlock.py)
    try:
        return _train(cfg, Path(run_dir), ctx, resume or extend_to is not None, progress, evaluate, data_source,
                      force, extend_to, preset, lock, save)
    except WriteFailed as e:  # a full disk: one line, and what is kept to continue from
        raise NclipError(f"{e}; {kept_note(Path(run_dir))}") from None
    finally:
        lock.release()
        teardown(ctx)


def _train(cfg: RunConfig, run_dir: Path, ctx: DistContext, resume: bool, progress: bool,
           evaluate: bool, data_source=None, force: bool = False, extend_to: int | None = None,
           preset: str | None = None, lock: DirLock | None = None, save: bool = True) -> RunResult:
    t = cfg.train
    if t.batch_size % (ctx.world_size * t.accumulation):
        raise NclipError(f"train.batch_size {t.batch_size} is not divisible by world size {ctx.world_size} "
                         f"× train.accumulation {t.accumulation}")
    with source_named("model.init"):  # the pretrained model's architecture replaces the config's (config.yaml)
        cfg = init_config(cfg, required=not resume, note=_note if ctx.is_main else lambda line: None)
    # every rank takes rank 0's decision about the run directory before anything is written
    plan = agree(ctx, lambda: plan_run(cfg, run_dir, resume, force, extend_to, lock))
    info, learner, counters, data_state = _restore(plan.cfg, run_dir, ctx, resume, save)
    if info.start >= info.cfg.train.steps:  # every rank: the step came from rank 0
        return RunResult(run_dir, info.start, already_finished=True)
    if data_source is None:  # a batch that cannot fit: one line, before anything is written
        check_step_memory(info, learner)
    if info.cfg.train.compile:  # after the check: its probe batches compile nothing (nclip.train.compile)
        compile_step(learner.step_module, learner.passes)
    data = _open_data(info, learner, data_source, data_state)
    periodic = PeriodicEval.for_run(info.cfg, ctx)  # train.eval_every: its data, before anything is written
    # the first write: a run that cannot start (bad config, missing data) leaves no trace
    if ctx.is_main:
        start_run(plan, run_dir)
        truncate_jsonl(run_dir / METRICS, lambda row: row.get("step", math.inf) <= info.start)
        print(startup_block(info, learner.model, data, periodic, preset), file=sys.stderr, flush=True)
    last = _run_steps(info, learner, data, periodic, counters, progress)
    return _finish(info, learner, last, evaluate)


def _restore(cfg: RunConfig, run_dir: Path, ctx: DistContext, resume: bool,
             save: bool) -> tuple[RunInfo, Learner, dict[str, int], dict | None]:
    """Build the model, objective and optimizer and, when resuming, restore them, the counters and
    this rank's RNG from the newest checkpoint. Returns the run, its learner, the loop's counters and
    this rank's saved data position. (The order of construction fixes the random initialisation: keep it.)"""
    t = cfg.train
    set_threads(t.threads, cfg, ctx.device)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg)
    lock_towers(model, cfg.model)  # model.vision/text.lock, unlocked_layers: out of the optimizer
    objective = build_objective(cfg.objective, cfg, label_space=label_space_for(cfg))
    start, state = 0, None
    if resume:
        start, weights, state = find_resume_point(run_dir, ctx)
        if state is not None:  # one line where they do not fit; a warning when the plugin's file changed
            restore_weights(model, objective, weights, state, cfg, checkpoint_dir(run_dir, start), ctx.is_main)
    if state is None and cfg.model.init is not None:  # a new run from a pretrained model's weights
        with source_named("model.init"):
            line = load_init_weights(model, cfg.model.init, cfg.model.init_arch)
        if ctx.is_main:
            _note(line)
    model.to(ctx.device)
    objective.to(ctx.device)
    step_module = TrainStep(model, objective, autocast_dtype(t.precision, ctx.device))
    module = wrap(step_module, ctx, cfg)
    info = RunInfo(cfg, run_dir, ctx, start, save)
    learner = Learner(step_module, module, build_optimizer([model, objective], t), ctx.device,
                      FirstStepCheck(cfg.objective.name))
    learner.ema = ema_for(model, t.ema, state)
    if cached_accumulation(cfg):
        learner.passes = wrap_passes(step_module, ctx, cfg)
        learner.tower_buffers = BufferSnapshot(online_towers(model))
        _note_tower_statistics(info, model)
    counters = {"nonfinite_total": 0, "nonfinite_row": 0}
    if state is None:
        learner.start_gate(counters)
        return info, learner, counters, None
    load_optimizer_state(module, learner.optimizer, state["optimizer_format"], state["optimizer"])
    counters.update({k: int(v) for k, v in state["counters"].items()})
    rngs = state["rng"]
    set_rng_state(rngs[ctx.rank] if len(rngs) == ctx.world_size else rngs[0])
    learner.start_gate(counters, state)
    return info, learner, counters, data_state_for_rank(state["data"], ctx)


def _note_tower_statistics(info: RunInfo, model: torch.nn.Module) -> None:
    """Exact accumulation cannot make BatchNorm inside a tower whole-batch: say so, once (rank 0)."""
    t = info.cfg.train
    towers = [name for name, tower in online_towers(model).items()
              if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training for m in tower.modules())]
    if towers and info.ctx.is_main:
        _note(f"nclip: note: train.accumulation {t.accumulation} (exact): the heads and the objective see the whole "
              f"batch, but BatchNorm inside the {' and '.join(towers)} tower computes its statistics per "
              f"micro-batch of {t.batch_size // (info.ctx.world_size * t.accumulation)} rows (docs/runs.md)")


def _open_data(info: RunInfo, learner: Learner, data_source, data_state: dict | None) -> DeviceFeed:
    """The run's batches from its start step, on its device (a DeviceFeed): train_loader's, or data_source's."""
    return DeviceFeed(_open_source(info, learner, data_source, data_state), info.ctx.device)


def _open_source(info: RunInfo, learner: Learner, data_source, data_state: dict | None):
    cfg, ctx = info.cfg, info.ctx
    if data_source is None:
        objective = plan_for(cfg)  # what it needs: views per image, per-row labels
        request = objective.label_request()
        if request is not None and request.frozen is not None:  # CMSF's cross-modal constraint
            from nclip.train.frozen_embedding import frozen_table

            learner.objective.attach_frozen_embedding(frozen_table(cfg, request.frozen, ctx.device))
        return train_loader(cfg, learner.model.tokenizer, start_step=info.start, rank=ctx.rank,
                            world_size=ctx.world_size, state=data_state, views=objective.views, labels=request,
                            device=ctx.device)
    return data_source(cfg=cfg, run_dir=info.run_dir, model=learner.model, objective=learner.objective,
                       optimizer=learner.optimizer, ctx=ctx, start=info.start, state=data_state)


def _step(info: RunInfo, learner: Learner, step: int, batch: Batch) -> StepResult:
    """One optimizer step: :func:`nclip.train.step.optimizer_step` (tests replace this to watch a step)."""
    return optimizer_step(learner, info.cfg, step, batch)


def _run_steps(info: RunInfo, learner: Learner, data, periodic: PeriodicEval | None, counters: dict[str, int],
               progress: bool) -> dict:
    """Every step from ``info.start`` to ``train.steps``, with logging and checkpoints; returns the
    last logged row. Stops with an NclipError after ``train.max_nonfinite_steps`` skipped in a row,
    noticed at a log or checkpoint step (the only steps that read the device), or at the end if none was taken."""
    t, ctx = info.cfg.train, info.ctx
    log = Log(info, data, counters, progress)
    learner.module.train()
    try:
        for step, batch in enumerate(data, start=info.start):
            try:
                result = _step(info, learner, step, batch)
            except torch.OutOfMemoryError:
                raise NclipError(out_of_memory_message(info.cfg, info.ctx.device, step)) from None
            done = step + 1
            logs = done % t.log_every == 0 or done == t.steps
            saves = done % t.checkpoint_every == 0 or done == t.steps
            evals = periodic is not None and periodic.due(done)  # its figures go on a row of their own step
            stop = None
            if logs or saves or evals:
                counters.update(learner.gate.counters())
                stop = nonfinite_stop(info.cfg, info.run_dir, counters, done, ctx.is_main)  # the line to stop with
            read = result.read(data.skipped, ctx.world_size) if logs or stop or evals else None
            log.step(done, read, periodic.at_step(info, learner) if evals else None)  # before the checkpoint of `done`
            if stop:
                raise NclipError(stop)
            if info.save and ((saves and counters["nonfinite_row"] == 0) or done == t.steps):
                save_run_state(info, learner, data, counters, done)
    finally:
        log.close()
    return log.last


def _finish(info: RunInfo, learner: Learner, last: dict, evaluate: bool) -> RunResult:
    """Save the final model (rank 0; whole again under FSDP) and run the end-of-run evaluation."""
    cfg, ctx = info.cfg, info.ctx
    weights = full_state_dict(learner.module)  # a collective under FSDP
    if ctx.distributed:
        dist.barrier()
    result = RunResult(info.run_dir, cfg.train.steps, metrics=last)
    if not ctx.is_main:
        return result
    final = learner.model
    if is_fsdp(learner.module):  # the sharded model cannot run on one rank: rebuild it whole
        final = build_model(cfg, pretrained_text=False)
        final.load_state_dict(strip_prefix(weights, "model."))
        final.to(ctx.device)
    final.eval()
    if info.save:
        save_run_models(final, cfg, info.run_dir, learner.ema)  # model/: the EMA when on, model-raw/ beside it
    if evaluate and cfg.data.source not in BUILTIN_SOURCES:
        print(f"nclip: note: no end-of-run evaluation for data.source {cfg.data.source}", file=sys.stderr)
    elif evaluate:
        from nclip.eval.quick import evaluate_run

        result.eval = evaluate_with_ema(lambda m: evaluate_run(m, cfg, ctx.device), final, learner.ema)
        if info.save:
            with writing(info.run_dir / "eval.json"):
                (info.run_dir / "eval.json").write_text(json.dumps(result.eval, indent=2, sort_keys=True))
    return result


def _note(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
