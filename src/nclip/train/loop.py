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

from nclip import distributed as collectives
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
from nclip.models.patch_dropout import patch_dropout_at, set_patch_dropout
from nclip.objectives import build_objective, plan_for
from nclip.objectives.contract import FirstStepCheck
from nclip.precision import autocast_dtype
from nclip.runlock import DirLock
from nclip.train.accumulate import cached_step, online_towers
from nclip.train.checkpoint import (
    checkpoint_dir,
    kept_note,
    newest_good_checkpoint,
    read_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from nclip.train.compile import compile_step
from nclip.train.ema import WeightEMA, ema_for, ema_state, evaluate_with_ema, save_run_models
from nclip.train.gate import StepGate
from nclip.train.launch import (
    DistContext,
    TrainStep,
    cached_accumulation,
    full_state_dict,
    is_fsdp,
    load_optimizer_state,
    no_grad_sync,
    optimizer_state,
    setup,
    sync_replicated_grads,
    teardown,
    wrap,
    wrap_passes,
)
from nclip.train.logbook import METRICS, Log, startup_block
from nclip.train.memory_check import check_step_memory, out_of_memory_message
from nclip.train.monitors import nonfinite_stop
from nclip.train.optim import build_optimizer, lr_at, set_lr
from nclip.train.periodic_eval import PeriodicEval
from nclip.train.resume_fit import plugin_source_state, restore_weights
from nclip.train.rundir import agree, plan_run, start_run
from nclip.train.snapshot import BufferSnapshot
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

    ``data_source``: builds the batches instead of :func:`train_loader` (see ``_train``); episodic
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
    run, data_state = _restore(plan.cfg, run_dir, ctx, resume)
    run.save = save
    if run.start >= run.cfg.train.steps:  # every rank: the step came from rank 0
        return RunResult(run_dir, run.start, already_finished=True)
    if data_source is None:  # a batch that cannot fit: one line, before anything is written
        check_step_memory(run)
    if run.cfg.train.compile:  # after the check: its probe batches compile nothing (nclip.train.compile)
        compile_step(run.step_module, run.passes)
    run.data = _open_data(run, data_source, data_state)
    run.periodic = PeriodicEval.for_run(run.cfg, ctx)  # train.eval_every: its data, before anything is written
    # the first write: a run that cannot start (bad config, missing data) leaves no trace
    if ctx.is_main:
        start_run(plan, run_dir)
        truncate_jsonl(run_dir / METRICS, lambda row: row.get("step", math.inf) <= run.start)
        print(startup_block(run, preset), file=sys.stderr, flush=True)
    last = _run_steps(run, progress)
    return _finish(run, last, evaluate)


@dataclass
class _Run:
    """What a training run holds from its restore to its finish."""

    cfg: RunConfig
    run_dir: Path
    ctx: DistContext
    model: torch.nn.Module
    step_module: TrainStep  # model + objective
    module: torch.nn.Module  # step_module, or DDP / FSDP2 around it
    optimizer: torch.optim.Optimizer
    start: int  # the step to continue from (0 for a new run)
    counters: dict = field(default_factory=lambda: {"nonfinite_total": 0, "nonfinite_row": 0})
    data: object = None  # the batches: train_loader or a data source such as EpisodicData
    snapshot: BufferSnapshot = None  # the step module's buffers before the current step
    gate: StepGate = None  # the device-side skip decision and counters
    passes: tuple | None = None  # (towers, heads) of gradient-cached accumulation, else None
    tower_buffers: BufferSnapshot | None = None  # the online towers' buffers, put back between passes
    ema: WeightEMA | None = None  # train.ema: the weights' moving average (nclip.train.ema)
    periodic: PeriodicEval | None = None  # evaluation while training (train.eval_every), else None
    save: bool = True  # False: no checkpoint, model/ or eval.json (train(save=False))
    check: FirstStepCheck = None  # the objective's dict of terms, checked on the first step

    def __post_init__(self):
        self.snapshot, self.check = BufferSnapshot(self.step_module), FirstStepCheck(self.cfg.objective.name)

    def start_gate(self, state: dict | None = None) -> None:
        """The skip gate and fp16's loss scale, as restored (call after the optimizer state is loaded)."""
        self.gate = StepGate(self.optimizer, self.ctx.device, self.counters, self.step_module.amp, state)


def _restore(cfg: RunConfig, run_dir: Path, ctx: DistContext, resume: bool) -> tuple[_Run, dict | None]:
    """Build the model, objective and optimizer and, when resuming, restore them, the counters and
    this rank's RNG from the newest checkpoint. Returns the run and this rank's saved data position.
    (The order of construction fixes the random initialisation: keep it.)"""
    t = cfg.train
    set_threads(t.threads, cfg, ctx.device)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg)
    lock_towers(model, cfg.model)  # model.vision/text.lock, unlocked_layers: out of the optimizer
    objective = build_objective(cfg.objective, cfg, label_space=label_space_for(cfg))
    start, state = 0, None
    if resume:
        start, weights, state = _find_resume_point(run_dir, ctx)
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
    run = _Run(cfg, run_dir, ctx, model, step_module, module, build_optimizer([model, objective], t), start)
    run.ema = ema_for(model, t.ema, state)
    if cached_accumulation(cfg):
        run.passes = wrap_passes(step_module, ctx, cfg)
        run.tower_buffers = BufferSnapshot(online_towers(model))
        _note_tower_statistics(run)
    if state is None:
        run.start_gate()
        return run, None
    load_optimizer_state(module, run.optimizer, state["optimizer_format"], state["optimizer"])
    run.counters.update({k: int(v) for k, v in state["counters"].items()})
    rngs = state["rng"]
    set_rng_state(rngs[ctx.rank] if len(rngs) == ctx.world_size else rngs[0])
    run.start_gate(state)
    return run, _data_state_for_rank(state["data"], ctx)


def _note_tower_statistics(run: _Run) -> None:
    """Exact accumulation cannot make BatchNorm inside a tower whole-batch: say so, once (rank 0)."""
    t = run.cfg.train
    towers = [name for name, tower in online_towers(run.model).items()
              if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training for m in tower.modules())]
    if towers and run.ctx.is_main:
        _note(f"nclip: note: train.accumulation {t.accumulation} (exact): the heads and the objective see the whole "
              f"batch, but BatchNorm inside the {' and '.join(towers)} tower computes its statistics per "
              f"micro-batch of {t.batch_size // (run.ctx.world_size * t.accumulation)} rows (docs/runs.md)")


def _open_data(run: _Run, data_source, data_state: dict | None) -> DeviceFeed:
    """The run's batches from its start step, on its device (a DeviceFeed): train_loader's, or data_source's."""
    return DeviceFeed(_open_source(run, data_source, data_state), run.ctx.device)


def _open_source(run: _Run, data_source, data_state: dict | None):
    cfg, ctx = run.cfg, run.ctx
    if data_source is None:
        objective = plan_for(cfg)  # what it needs: views per image, per-row labels
        request = objective.label_request()
        if request is not None and request.frozen is not None:  # CMSF's cross-modal constraint
            from nclip.train.frozen_embedding import frozen_table

            run.step_module.objective.attach_frozen_embedding(frozen_table(cfg, request.frozen, ctx.device))
        return train_loader(cfg, run.model.tokenizer, start_step=run.start, rank=ctx.rank,
                            world_size=ctx.world_size, state=data_state, views=objective.views, labels=request,
                            device=ctx.device)
    return data_source(cfg=cfg, run_dir=run.run_dir, model=run.model, objective=run.step_module.objective,
                       optimizer=run.optimizer, ctx=ctx, start=run.start, state=data_state)


@dataclass
class _StepResult:
    """One step as the device left it: nothing here has been read on the host."""

    lr: float
    keys: list[str]  # the objective's term names
    terms: torch.Tensor  # [len(keys)]: this rank's terms (means over micro-batches)
    grad_norm: torch.Tensor  # 0-d
    skip: torch.Tensor  # 0-d, 1: the step was skipped on every rank


@dataclass
class _LoggedStep:
    """A step read on the host (at log steps), what :class:`nclip.train.logbook.Log` writes."""

    lr: float
    terms: dict[str, float]  # the objective's terms, means over micro-batches and ranks
    grad_norm: float
    skipped_samples: int  # bad data samples skipped so far, summed over ranks
    finite: bool  # False: the step was skipped on every rank


def _read(run: _Run, result: _StepResult) -> _LoggedStep:
    """The host's copy of a step's figures: one small no-grad all-reduce (the terms, logged as
    means over ranks, and the bad-sample count) and one read; a collective, on every rank."""
    device = run.ctx.device
    skipped = torch.tensor([float(run.data.skipped)], device=device)
    stats = collectives.all_reduce_sum_no_grad(torch.cat([result.terms, skipped]).double())
    values = torch.cat([stats, torch.stack([result.grad_norm, result.skip]).double()]).tolist()
    terms = {k: v / run.ctx.world_size for k, v in zip(result.keys, values)}
    return _LoggedStep(result.lr, terms, values[-2], int(values[-3]), values[-1] == 0)


def _term_vector(terms: dict, keys: list[str]) -> torch.Tensor:
    """The step's terms as one vector on the device. Objectives make every term a tensor on the
    model's device (a constant with ``loss.new_full``): a host number here would be a blocking
    host-to-device copy on every step, so it is refused."""
    for k in keys:
        if not torch.is_tensor(terms[k]):
            raise TypeError(f"the objective's term {k!r} is a {type(terms[k]).__name__}, not a tensor on the device")
    return torch.stack([terms[k].detach().float() for k in keys])


def _step(run: _Run, step: int, batch: Batch) -> _StepResult:
    """One optimizer step on this rank's rows of one global batch, already on the device (its
    per-row tensors, e.g. ProtoCLIP's episode positions, reach the objective). A step whose loss or
    gradient is not finite on any rank is skipped on all, decided on the device
    (:mod:`nclip.train.gate`): nothing here waits on the host."""
    t, device, module, optimizer = run.cfg.train, run.ctx.device, run.module, run.optimizer
    lr = lr_at(step, t)
    for group in optimizer.param_groups:
        set_lr(group, lr * group.get("lr_scale", 1.0))  # lr_scale: e.g. 0 for a locked tower
    run.snapshot.take()  # the buffers, put back if the step is skipped
    run.step_module.objective.before_step(step, t.steps)  # e.g. a loss weight scheduled by the step
    set_patch_dropout(run.model, patch_dropout_at(run.cfg, step))  # FLIP: 0 in train.unmasked_steps' tail
    if run.passes is not None:  # exact accumulation: the whole batch's objective in k tower passes
        terms = cached_step(*run.passes, batch, t.accumulation, run.tower_buffers, device, run.gate.scaled,
                            run.check)
        keys = list(terms)
        vector = _term_vector(terms, keys)
        nonfinite_loss = (~torch.isfinite(terms["loss"].detach())).float()
    else:
        keys, vector, nonfinite_loss = _independent_micro_batches(run, batch)
    keys, vector = run.gate.logged(keys, vector)  # fp16: and the loss scale
    sync_replicated_grads(module)  # FSDP2's unsharded scalars (logit scale): averaged like DDP
    grad_norm = run.gate.grad_norm(t.grad_clip)  # clipped to train.grad_clip (null: no ×1); fp16: of the unscaled grads
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a replicated DTensor
        grad_norm = grad_norm.full_tensor()
    skip = run.gate.decide(nonfinite_loss, grad_norm)  # every rank takes the same decision
    run.gate.step(skip)  # the optimizer update, unless skip
    run.snapshot.restore_where(skip)  # a skipped step leaves the buffers as they were
    run.step_module.objective.after_step(run.model, step, t.steps, taken=1 - skip)  # e.g. CMSF's momentum update
    if run.ema is not None:
        run.ema.update(taken=1 - skip)  # a skipped step leaves the average as it was
    optimizer.zero_grad(set_to_none=True)
    return _StepResult(lr, keys, vector, grad_norm.detach(), skip)


def _independent_micro_batches(run: _Run, batch: Batch) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """Forward and backward of ``train.accumulation`` micro-batches, each its own contrastive batch
    (one micro-batch: the whole batch). Returns (term names, the terms' means, non-finite losses)."""
    k, module, device = run.cfg.train.accumulation, run.module, run.ctx.device
    keys: list[str] = []
    sums: torch.Tensor | None = None
    nonfinite_loss = torch.zeros((), device=device)
    chunks = batch.chunk(k)
    for i, micro in enumerate(chunks):
        # gradients are all-reduced on the last micro-batch only; a non-finite loss is still
        # back-propagated so that every rank runs the same collectives
        with no_grad_sync(module, skip=i < len(chunks) - 1):
            terms = run.check(module(micro))
            loss = terms["loss"]
            run.gate.scaled(loss / k).backward()  # fp16: times the loss scale
        nonfinite_loss += (~torch.isfinite(loss.detach())).float()
        keys = keys or list(terms)
        vector = _term_vector(terms, keys)
        vector = vector / k if k > 1 else vector
        sums = vector if sums is None else sums + vector
    return keys, sums, nonfinite_loss


def _run_steps(run: _Run, progress: bool) -> dict:
    """Every step from ``run.start`` to ``train.steps``, with logging and checkpoints; returns the
    last logged row. Stops with an NclipError after ``train.max_nonfinite_steps`` skipped in a row,
    noticed at a log or checkpoint step (the only steps that read the device), or at the end if none was taken."""
    t, counters = run.cfg.train, run.counters
    log = Log(run, progress)
    run.module.train()
    try:
        for step, batch in enumerate(run.data, start=run.start):
            try:
                result = _step(run, step, batch)
            except torch.OutOfMemoryError:
                raise NclipError(out_of_memory_message(run.cfg, run.ctx.device, step)) from None
            done = step + 1
            logs = done % t.log_every == 0 or done == t.steps
            saves = done % t.checkpoint_every == 0 or done == t.steps
            evals = run.periodic is not None and run.periodic.due(done)  # its figures go on a row of their own step
            stop = None
            if logs or saves or evals:
                counters.update(run.gate.counters())
                stop = nonfinite_stop(run.cfg, run.run_dir, counters, done, run.ctx.is_main)  # the line to stop with
            read = _read(run, result) if logs or stop or evals else None
            log.step(done, read, run.periodic.at_step(run) if evals else None)  # before the checkpoint of `done`
            if stop:
                raise NclipError(stop)
            if run.save and ((saves and counters["nonfinite_row"] == 0) or done == t.steps):
                _save(run, done)
    finally:
        log.close()
    return log.last


def _finish(run: _Run, last: dict, evaluate: bool) -> RunResult:
    """Save the final model (rank 0; whole again under FSDP) and run the end-of-run evaluation."""
    cfg, ctx = run.cfg, run.ctx
    weights = full_state_dict(run.module)  # a collective under FSDP
    if ctx.distributed:
        dist.barrier()
    result = RunResult(run.run_dir, cfg.train.steps, metrics=last)
    if not ctx.is_main:
        return result
    final = run.model
    if is_fsdp(run.module):  # the sharded model cannot run on one rank: rebuild it whole
        final = build_model(cfg, pretrained_text=False)
        final.load_state_dict(_strip(weights, "model."))
        final.to(ctx.device)
    final.eval()
    if run.save:
        save_run_models(final, cfg, run.run_dir, run.ema)  # model/: the EMA when on, model-raw/ beside it
    if evaluate and cfg.data.source not in BUILTIN_SOURCES:
        print(f"nclip: note: no end-of-run evaluation for data.source {cfg.data.source}", file=sys.stderr)
    elif evaluate:
        from nclip.eval.quick import evaluate_run

        result.eval = evaluate_with_ema(lambda m: evaluate_run(m, cfg, ctx.device), final, run.ema)
        if run.save:
            with writing(run.run_dir / "eval.json"):
                (run.run_dir / "eval.json").write_text(json.dumps(result.eval, indent=2, sort_keys=True))
    return result


def _find_resume_point(run_dir: Path, ctx: DistContext) -> tuple[int, dict | None, dict | None]:
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


def _data_state_for_rank(states: list, ctx: DistContext) -> dict | None:
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


def _save(run: _Run, step: int) -> None:
    """A checkpoint of ``step``: collectives on every rank, written by rank 0."""
    ctx = run.ctx
    full = full_state_dict(run.module)  # collectives under FSDP: every rank takes part
    fmt, opt_state = optimizer_state(run.module, run.optimizer)
    local = {"rng": rng_state(), "data": run.data.state()}
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
        "objective": _strip(full, "objective."),
        "rng": [e["rng"] for e in everyone],
        "data": [e["data"] for e in everyone],
        "world_size": ctx.world_size, **plugin_source_state(run.cfg),  # a plugin's file, compared on resume
        "counters": dict(run.counters),
        **ema_state(run.ema), **run.gate.checkpoint_state(),  # the EMA; fp16's loss scale
    }
    save_checkpoint(run.run_dir, step, _strip(full, "model."), state, run.cfg.train.keep_checkpoints)


def _strip(state: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def _note(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
