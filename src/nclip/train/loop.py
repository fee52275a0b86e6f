"""The training loop: config → data + model → objective → optimizer steps → checkpoints → eval.

The loop never knows which objective it runs: it gets a loss and a dict of named terms, logs
them, and steps. One optimizer step consumes one global batch (``train.batch_size`` pairs), split
over the ranks and, on each rank, into ``train.accumulation`` micro-batches; each micro-batch is
its own contrastive batch (gathered over the ranks when the objective uses the global batch).

Distributed (``torchrun``, see docs/distributed.md and :mod:`nclip.launch`): every rank runs this
loop on its slice of every global batch; DDP or FSDP2 average the gradients; the logged terms are
means over ranks (no-grad all-reduce, so metrics.jsonl shows global values); rank 0 alone writes
logs, checkpoints, the final model and the evaluation.

Faults: a step whose loss or gradient is not finite on any rank is skipped on every rank (weights,
optimizer and buffers such as BatchNorm statistics untouched) and counted; after
``train.max_nonfinite_steps`` in a row the run stops with an :class:`NclipError`, keeping the last
good checkpoint (none is written during such a streak). Bad data samples are skipped by the data
layer and counted (``data/skipped``).

Exact resume: a checkpoint holds the weights, the optimizer, the step (schedule and data position),
every rank's RNG states and data position, and the loop's counters, so a run killed at any point
(SIGKILL included) and resumed with ``--resume auto`` writes the same metrics.jsonl as a run never
interrupted (bitwise on CPU, wall-clock fields aside).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from nclip import distributed as D
from nclip.config import RunConfig
from nclip.data.loader import train_loader
from nclip.errors import NclipError
from nclip.launch import (DistContext, TrainStep, full_state_dict, is_fsdp, load_optimizer_state, no_grad_sync,
                          optimizer_state, setup, sync_replicated_grads, teardown, wrap)
from nclip.models import build_model
from nclip.models.io import save_model
from nclip.objectives import REGISTRY, build_objective
from nclip.precision import autocast_dtype
from nclip.train.checkpoint import (checkpoint_dir, newest_good_checkpoint, read_checkpoint, rng_state,
                                    save_checkpoint, set_rng_state)
from nclip.train.monitors import CollapseMonitor
from nclip.train.optim import build_optimizer, lr_at
from nclip.train.rundir import agree, plan_run, start_run

BUILTIN_SOURCES = ("synthetic", "digits")


@dataclass
class RunResult:
    run_dir: Path
    steps: int
    metrics: dict = field(default_factory=dict)  # last logged metrics (rank 0)
    eval: dict = field(default_factory=dict)
    already_finished: bool = False  # resumed a run that had reached its steps: nothing was done


def pick_device(cfg: RunConfig) -> torch.device:
    want = cfg.train.device
    if want == "cuda" and not torch.cuda.is_available():
        raise NclipError("train.device is 'cuda' but no CUDA device is available")
    return torch.device("cuda" if want == "cuda" or (want == "auto" and torch.cuda.is_available()) else "cpu")


def train(cfg: RunConfig, run_dir: str | Path, resume: bool = False, progress: bool = True,
          evaluate: bool = True, data_source=None, force: bool = False, extend_to: int | None = None) -> RunResult:
    """Train per ``cfg`` into ``run_dir``; under torchrun on every rank (see the module docstring).

    The run directory's rules (:mod:`nclip.train.rundir`, docs/runs.md): a directory that holds a
    run is refused unless ``resume`` (same config, up to a few keys) or ``force`` (start over);
    ``extend_to`` (implies ``resume``) trains a run beyond its ``train.steps``. Resuming a run that
    has reached its steps returns ``already_finished`` and touches nothing.

    ``data_source``: builds the batches instead of :func:`train_loader` (see ``_train``); episodic
    objectives (``Objective.episodic``, e.g. ProtoCLIP) get :class:`nclip.train.episodic.EpisodicData`.
    """
    if data_source is None and getattr(REGISTRY[cfg.objective.name][1], "episodic", False):
        from nclip.train.episodic import EpisodicData

        data_source = EpisodicData
    ctx = setup(cfg)
    try:
        return _train(cfg, Path(run_dir), ctx, resume or extend_to is not None, progress, evaluate, data_source,
                      force, extend_to)
    finally:
        teardown(ctx)


def _train(cfg: RunConfig, run_dir: Path, ctx: DistContext, resume: bool, progress: bool,
           evaluate: bool, data_source=None, force: bool = False, extend_to: int | None = None) -> RunResult:
    t = cfg.train
    if t.batch_size % (ctx.world_size * t.accumulation):
        raise NclipError(f"train.batch_size {t.batch_size} is not divisible by world size {ctx.world_size} "
                         f"× train.accumulation {t.accumulation}")
    # every rank takes rank 0's decision about the run directory before anything is written
    plan = agree(ctx, lambda: plan_run(cfg, run_dir, resume, force, extend_to))
    cfg, t = plan.cfg, plan.cfg.train
    if t.threads:
        torch.set_num_threads(t.threads)
    torch.manual_seed(cfg.seed)
    device = ctx.device
    amp = autocast_dtype(cfg.train.precision, device)

    model = build_model(cfg)
    objective = build_objective(cfg.objective)
    start, state = 0, None
    if resume:
        start, weights, state = _find_resume_point(run_dir, ctx)
        if state is not None:
            model.load_state_dict(weights)
            objective.load_state_dict(state["objective"])
    if start >= t.steps:  # every rank: the step came from rank 0
        return RunResult(run_dir, start, already_finished=True)
    model.to(device)
    objective.to(device)
    step_module = TrainStep(model, objective, amp)
    module = wrap(step_module, ctx, cfg)
    optimizer = build_optimizer([model, objective], t)
    counters = {"nonfinite_total": 0, "nonfinite_row": 0}
    data_state = None
    if state is not None:
        load_optimizer_state(module, optimizer, state.get("optimizer_format", "ids"), state["optimizer"])
        counters.update({k: int(v) for k, v in state.get("counters", {}).items()})
        counters["nonfinite_total"] = int(state.get("nonfinite_total", counters["nonfinite_total"]))
        rngs = state.get("rng") or [{"torch": state["rng_torch"]}]
        data_states = state.get("data") or []
        same_world = len(rngs) == ctx.world_size
        set_rng_state(rngs[ctx.rank] if same_world else rngs[0])
        data_state = _data_state_for_rank(data_states, ctx)

    if data_source is None:
        data = train_loader(cfg, model.tokenizer, start_step=start, rank=ctx.rank, world_size=ctx.world_size,
                            state=data_state)
    else:  # e.g. nclip.train.episodic.EpisodicData: the same interface, built with the run's objects
        data = data_source(cfg=cfg, run_dir=run_dir, model=model, objective=objective, optimizer=optimizer,
                           ctx=ctx, start=start, state=data_state)

    # the first write: a run that cannot start (bad config, missing data) leaves no trace
    metrics_path = run_dir / "metrics.jsonl"
    if ctx.is_main:
        start_run(plan, run_dir)
        if start > 0:
            _truncate_metrics(metrics_path, start)
        elif metrics_path.exists():
            metrics_path.unlink()

    accum = t.accumulation
    params = [p for g in optimizer.param_groups for p in g["params"]]
    monitor = CollapseMonitor.for_run(cfg)
    bar = tqdm(total=t.steps, initial=start, unit="step", disable=not (progress and ctx.is_main), dynamic_ncols=True)
    window_t, window_samples, last = time.perf_counter(), 0, {}
    module.train()
    log = metrics_path.open("a") if ctx.is_main else None
    try:
        # a batch is (pixels, ids, mask, *rows): a data source may add per-row tensors (ProtoCLIP's
        # episode positions), split like the batch and passed on to the objective
        for step, (pixels, ids, mask, *rows) in enumerate(data, start=start):
            lr = lr_at(step, t)
            for group in optimizer.param_groups:
                group["lr"] = lr * group.get("lr_scale", 1.0)  # lr_scale: e.g. 0 for a locked tower
            snapshot = _buffers(step_module)  # restored if the step is skipped
            sums: dict[str, torch.Tensor] = {}
            nonfinite_loss = torch.zeros((), device=device)
            chunks = list(zip(pixels.chunk(accum), ids.chunk(accum), mask.chunk(accum), *(r.chunk(accum) for r in rows)))
            for i, (p_mb, i_mb, m_mb, *r_mb) in enumerate(chunks):
                # gradients are all-reduced on the last micro-batch only; a non-finite loss is
                # still back-propagated so that every rank runs the same collectives
                with no_grad_sync(module, skip=i < len(chunks) - 1):
                    terms = module(p_mb.to(device, non_blocking=True), i_mb.to(device), m_mb.to(device),
                                   *(r.to(device) for r in r_mb))
                    loss = terms["loss"]
                    (loss / accum).backward()
                nonfinite_loss += (~torch.isfinite(loss.detach())).float()
                for k, v in terms.items():
                    v = v.detach().float() if torch.is_tensor(v) else torch.tensor(float(v), device=device)
                    sums[k] = sums.get(k, 0.0) + v / accum
            sync_replicated_grads(module)  # FSDP2's unsharded scalars (logit scale): averaged like DDP
            grad_norm = torch.nn.utils.clip_grad_norm_(params, t.grad_clip if t.grad_clip else math.inf)
            if hasattr(grad_norm, "full_tensor"):  # FSDP2: a replicated DTensor
                grad_norm = grad_norm.full_tensor()
            # one small no-grad all-reduce per step: the terms (logged as means over ranks), the
            # non-finite flag (every rank must take the same decision) and the bad-sample count
            keys = list(sums)
            stats = torch.stack([sums[k] for k in keys] + [nonfinite_loss, torch.tensor(float(data.skipped), device=device)])
            stats = D.all_reduce_sum_no_grad(stats.double()).tolist()
            term_means = {k: v / ctx.world_size for k, v in zip(keys, stats)}
            grad_norm = float(grad_norm)
            finite = stats[-2] == 0 and math.isfinite(grad_norm)
            if finite:
                optimizer.step()
                counters["nonfinite_row"] = 0
            else:  # skip the step: weights, optimizer state and buffers stay as they were
                _restore_buffers(step_module, snapshot)
                counters["nonfinite_total"] += 1
                counters["nonfinite_row"] += 1
            optimizer.zero_grad(set_to_none=True)

            done = step + 1
            window_samples += t.batch_size
            stop = counters["nonfinite_row"] >= t.max_nonfinite_steps
            if done % t.log_every == 0 or done == t.steps or stop:
                now = time.perf_counter()
                last = {
                    "step": done,
                    "lr": lr,
                    **term_means,
                    "grad_norm": grad_norm,
                    "nonfinite_steps": counters["nonfinite_total"],
                    "data/skipped": int(stats[-1]),
                    "samples_per_s": window_samples / max(now - window_t, 1e-9),
                }
                if monitor is not None and ctx.is_main:
                    for warning in monitor.update(done, last):
                        last.setdefault("monitor/warnings", []).append(warning)
                        tqdm.write(f"nclip: warning: {warning}", file=sys.stderr)
                if log is not None:
                    log.write(json.dumps(last) + "\n")
                    log.flush()
                window_t, window_samples = now, 0
                bar.set_postfix(loss=f"{last.get('loss', float('nan')):.3f}",
                                samples_s=f"{last['samples_per_s']:.0f}", refresh=False)
            if stop:
                raise NclipError(
                    f"{counters['nonfinite_row']} steps in a row had a non-finite loss or gradient "
                    f"(last: step {done}); stopping. The last good checkpoint is kept in {run_dir / 'checkpoints'}")
            if (done % t.checkpoint_every == 0 and counters["nonfinite_row"] == 0) or done == t.steps:
                _save(run_dir, done, module, optimizer, data, counters, ctx, t.keep_checkpoints)
            bar.update(1)
    finally:
        if log is not None:
            log.close()
        bar.close()

    weights = full_state_dict(module)  # a collective under FSDP
    if ctx.distributed:
        dist.barrier()
    result = RunResult(run_dir, t.steps, metrics=last)
    if not ctx.is_main:
        return result
    final = model
    if is_fsdp(module):  # the sharded model cannot run on one rank: rebuild it whole
        final = build_model(cfg, pretrained_text=False)
        final.load_state_dict(_strip(weights, "model."))
        final.to(device)
    final.eval()
    save_model(final, cfg, run_dir / "model")
    if evaluate and cfg.data.source not in BUILTIN_SOURCES:
        print(f"nclip: note: no end-of-run evaluation for data.source {cfg.data.source}", file=sys.stderr)
    elif evaluate:
        from nclip.eval.quick import evaluate_run

        result.eval = evaluate_run(final, cfg, device)
        (run_dir / "eval.json").write_text(json.dumps(result.eval, indent=2, sort_keys=True))
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


def _save(run_dir: Path, step: int, module, optimizer, data, counters: dict, ctx: DistContext, keep: int) -> None:
    full = full_state_dict(module)  # collectives under FSDP: every rank takes part
    fmt, opt_state = optimizer_state(module, optimizer)
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
        "objective": _strip(full, "objective."),
        "rng": [e["rng"] for e in everyone],
        "data": [e["data"] for e in everyone],
        "world_size": ctx.world_size,
        "counters": dict(counters),
    }
    save_checkpoint(run_dir, step, _strip(full, "model."), state, keep)


def _buffers(module) -> dict[str, torch.Tensor]:
    """Copies of every registered buffer (BatchNorm statistics, objective queues and centers)."""
    return {name: b.detach().clone() for name, b in module.named_buffers()}


@torch.no_grad()
def _restore_buffers(module, snapshot: dict[str, torch.Tensor]) -> None:
    """Put the buffers back as they were before a skipped step (re-registering any that the step
    replaced by a new tensor, e.g. a lazily sized one)."""
    current = dict(module.named_buffers())
    for name, saved in snapshot.items():
        b = current.get(name)
        if b is not None and b.shape == saved.shape and b.dtype == saved.dtype:
            b.copy_(saved)
        else:
            owner, _, attr = name.rpartition(".")
            module.get_submodule(owner).register_buffer(attr, saved)


def _strip(state: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop log lines written after the checkpoint we resume from (they will be written again),
    and a last line torn by a crash in the middle of writing it."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and row.get("step", math.inf) <= step:
            kept.append(line)
    path.write_text("".join(line + "\n" for line in kept))
