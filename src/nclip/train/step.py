"""One optimizer step: the model-plus-objective module and the update it drives.

:class:`TrainStep` is model + objective as one module, a :class:`~nclip.batch.Batch` → the
objective's dict of terms; under gradient-cached accumulation (:mod:`nclip.train.accumulate`) it
runs in two halves, :class:`TowerPass` (the towers) and :class:`HeadPass` (heads and objective).
:class:`Learner` is what a step reads and changes (the wrapped module, the optimizer, the skip
gate, the buffer snapshot, the EMA), and :func:`optimizer_step` is one step on this rank's rows of
one global batch. Nothing here knows the loop: the loop builds a Learner and calls
:func:`optimizer_step` once per batch.

A step whose loss or gradient is not finite on any rank is skipped on all, decided on the device
(:mod:`nclip.train.gate`): nothing in a step waits on the host. :meth:`StepResult.read` is the
host's copy of a step's figures, taken at log steps only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from nclip import distributed as collectives
from nclip.batch import Batch
from nclip.config import RunConfig
from nclip.models.patch_dropout import patch_dropout_at, set_patch_dropout
from nclip.objectives.contract import FirstStepCheck
from nclip.precision import to_float32, tower_autocast
from nclip.train.accumulate import TOWERS, cached_step
from nclip.train.ema import WeightEMA
from nclip.train.gate import StepGate
from nclip.train.launch import DistContext, ddp, find_unused, no_grad_sync, sync_replicated_grads
from nclip.train.optim import lr_at, set_lr
from nclip.train.snapshot import BufferSnapshot

__all__ = ["TrainStep", "TowerPass", "HeadPass", "wrap_passes", "Learner", "StepResult", "LoggedStep",
           "optimizer_step"]


class TrainStep(nn.Module):
    """model + objective as one module: a :class:`~nclip.batch.Batch` → the objective's dict of terms.

    The towers and heads run under autocast (bf16 on CUDA by default); their outputs are cast to
    float32 as they leave it (:func:`nclip.precision.to_float32`), so the objective, whatever
    precision the towers ran in, computes in float32. The logit scale used by this forward is added
    as the ``logit_scale`` term.
    """

    def __init__(self, model: nn.Module, objective: nn.Module, amp: torch.dtype | None = None):
        super().__init__()
        self.model, self.objective, self.amp = model, objective, amp

    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        """The model reads the batch's pixels, ids and mask; the objective gets the whole batch for
        its per-row tensors (labels, dataset indices, episode positions): ``objective(out, batch)``."""
        with tower_autocast(batch.pixels.device, self.amp):
            out = self.model(batch.pixels, batch.ids, batch.mask)
        return _objective_terms(self.objective, out, batch)


def _objective_terms(objective: nn.Module, out, batch: Batch) -> dict[str, torch.Tensor]:
    terms = objective(to_float32(out), batch)
    if isinstance(terms, dict) and "logit_scale" not in terms:  # anything else: refused on the first step (contract.py)
        terms["logit_scale"] = out.logit_scale.detach()
    return terms


class TowerPass(nn.Module):
    """The towers of a :class:`TrainStep`: a batch → the towers' features
    (``DualEncoder.tower_features``). It registers the towers alone, so that DDP around it
    averages their gradients and nothing else; the model is held without registering it."""

    def __init__(self, step: TrainStep):
        super().__init__()
        for name in TOWERS:
            if hasattr(step.model, name):
                self.add_module(name, getattr(step.model, name))
        self._step = [step]  # a list: not a registered submodule
        self.amp = step.amp

    def forward(self, batch: Batch, target: bool = True) -> dict[str, torch.Tensor]:
        with tower_autocast(batch.pixels.device, self.amp):
            return self._step[0].model.tower_features(batch.pixels, batch.ids, batch.mask, target=target)


class HeadPass(nn.Module):
    """The heads and the objective of a :class:`TrainStep`: the towers' features (of the whole
    batch) and the batch (its per-row tensors) → the objective's dict of terms. Registers every part
    of the step that :class:`TowerPass` does not (heads, logit scale, the objective)."""

    def __init__(self, step: TrainStep):
        super().__init__()
        model = step.model
        for name, child in model.named_children():
            if name not in TOWERS:
                self.add_module(name, child)
        for name, p in model.named_parameters(recurse=False):  # the logit scale
            self.register_parameter(name, p)
        self.objective = step.objective
        self._step = [step]
        self.amp = step.amp

    def forward(self, feats: dict[str, torch.Tensor], batch: Batch) -> dict[str, torch.Tensor]:
        step = self._step[0]
        device = next(iter(feats.values())).device
        with tower_autocast(device, self.amp):
            out = step.model.head_outputs(feats)
        return _objective_terms(self.objective, out, batch)


def wrap_passes(step: TrainStep, ctx: DistContext, cfg: RunConfig) -> tuple[nn.Module, nn.Module]:
    """(towers, heads) of gradient-cached accumulation: :class:`TowerPass` and :class:`HeadPass`,
    each in its own DDP under torchrun (their parameters are disjoint, and each pass uses all of
    its own: the heads' gradients are averaged after the one heads backward, the towers' after the
    last micro-batch's). Call after :func:`nclip.train.launch.wrap` (which converts BatchNorm in
    place first)."""
    towers, heads = TowerPass(step), HeadPass(step)
    if not ctx.distributed:
        return towers, heads
    if not any(p.requires_grad for p in towers.parameters()):  # both towers locked: nothing to average
        return towers, ddp(heads, ctx, False)
    return ddp(towers, ctx, find_unused(cfg)), ddp(heads, ctx, False)


@dataclass
class Learner:
    """What an optimizer step reads and changes: the model-plus-objective module and the module the
    step calls (itself, or DDP / FSDP2 around it), the optimizer, and the state kept beside them."""

    step_module: TrainStep
    module: nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    check: FirstStepCheck  # the objective's dict of terms, checked on the first step
    passes: tuple[nn.Module, nn.Module] | None = None  # (towers, heads) of gradient-cached accumulation
    tower_buffers: BufferSnapshot | None = None  # the online towers' buffers, put back between the passes
    ema: WeightEMA | None = None  # train.ema: the weights' moving average (nclip.train.ema)
    gate: StepGate | None = None  # the device-side skip decision and counters: start_gate()
    snapshot: BufferSnapshot = field(init=False)  # the step module's buffers before the current step

    def __post_init__(self):
        self.snapshot = BufferSnapshot(self.step_module)

    @property
    def model(self) -> nn.Module:
        return self.step_module.model

    @property
    def objective(self) -> nn.Module:
        return self.step_module.objective

    def start_gate(self, counters: dict[str, int], state: dict | None = None) -> None:
        """The skip gate and fp16's loss scale, as restored (call after the optimizer state is loaded)."""
        self.gate = StepGate(self.optimizer, self.device, counters, self.step_module.amp, state)


@dataclass
class StepResult:
    """One step as the device left it: nothing here has been read on the host."""

    lr: float
    keys: list[str]  # the objective's term names
    terms: torch.Tensor  # [len(keys)]: this rank's terms (means over micro-batches)
    grad_norm: torch.Tensor  # 0-d
    skip: torch.Tensor  # 0-d, 1: the step was skipped on every rank

    def read(self, skipped_samples: int, world_size: int) -> LoggedStep:
        """The host's copy of the step's figures: one small no-grad all-reduce (the terms, logged as
        means over ranks, and the bad-sample count) and one read; a collective, on every rank."""
        skipped = torch.tensor([float(skipped_samples)], device=self.terms.device)
        stats = collectives.all_reduce_sum_no_grad(torch.cat([self.terms, skipped]).double())
        values = torch.cat([stats, torch.stack([self.grad_norm, self.skip]).double()]).tolist()
        terms = {k: v / world_size for k, v in zip(self.keys, values)}
        return LoggedStep(self.lr, terms, values[-2], int(values[-3]), values[-1] == 0)


@dataclass
class LoggedStep:
    """A step read on the host (at log steps), what :class:`nclip.train.logbook.Log` writes."""

    lr: float
    terms: dict[str, float]  # the objective's terms, means over micro-batches and ranks
    grad_norm: float
    skipped_samples: int  # bad data samples skipped so far, summed over ranks
    finite: bool  # False: the step was skipped on every rank


def optimizer_step(learner: Learner, cfg: RunConfig, step: int, batch: Batch) -> StepResult:
    """One optimizer step on this rank's rows of one global batch, already on the device (its
    per-row tensors, e.g. ProtoCLIP's episode positions, reach the objective)."""
    t, optimizer, objective = cfg.train, learner.optimizer, learner.objective
    lr = lr_at(step, t)
    for group in optimizer.param_groups:
        set_lr(group, lr * group.get("lr_scale", 1.0))  # lr_scale: e.g. 0 for a locked tower
    learner.snapshot.take()  # the buffers, put back if the step is skipped
    objective.before_step(step, t.steps)  # e.g. a loss weight scheduled by the step
    set_patch_dropout(learner.model, patch_dropout_at(cfg, step))  # FLIP: 0 in train.unmasked_steps' tail
    if learner.passes is not None:  # exact accumulation: the whole batch's objective in k tower passes
        terms = cached_step(*learner.passes, batch, t.accumulation, learner.tower_buffers, learner.device,
                            learner.gate.scaled, learner.check)
        keys = list(terms)
        vector = _term_vector(terms, keys)
        nonfinite_loss = (~torch.isfinite(terms["loss"].detach())).float()
    else:
        keys, vector, nonfinite_loss = _independent_micro_batches(learner, t.accumulation, batch)
    sync_replicated_grads(learner.module)  # FSDP2's unsharded scalars (logit scale): averaged like DDP
    keys, vector, grad_norm, skip = learner.gate.update(keys, vector, nonfinite_loss, t.grad_clip)
    learner.snapshot.restore_where(skip)  # a skipped step leaves the buffers as they were
    objective.after_step(learner.model, step, t.steps, taken=1 - skip)  # e.g. CMSF's momentum update
    if learner.ema is not None:
        learner.ema.update(taken=1 - skip)  # a skipped step leaves the average as it was
    optimizer.zero_grad(set_to_none=True)
    return StepResult(lr, keys, vector, grad_norm.detach(), skip)


def _independent_micro_batches(learner: Learner, k: int, batch: Batch) -> tuple[list[str], torch.Tensor,
                                                                                  torch.Tensor]:
    """Forward and backward of ``k`` micro-batches, each its own contrastive batch (one micro-batch:
    the whole batch). Returns (term names, the terms' means, non-finite losses)."""
    module = learner.module
    keys: list[str] = []
    sums: torch.Tensor | None = None
    nonfinite_loss = torch.zeros((), device=learner.device)
    chunks = batch.chunk(k)
    for i, micro in enumerate(chunks):
        # gradients are all-reduced on the last micro-batch only; a non-finite loss is still
        # back-propagated so that every rank runs the same collectives
        with no_grad_sync(module, skip=i < len(chunks) - 1):
            terms = learner.check(module(micro))
            loss = terms["loss"]
            learner.gate.scaled(loss / k).backward()  # fp16: times the loss scale
        nonfinite_loss += (~torch.isfinite(loss.detach())).float()
        keys = keys or list(terms)
        vector = _term_vector(terms, keys)
        vector = vector / k if k > 1 else vector
        sums = vector if sums is None else sums + vector
    return keys, sums, nonfinite_loss


def _term_vector(terms: dict, keys: list[str]) -> torch.Tensor:
    """The step's terms as one vector on the device. Objectives make every term a tensor on the
    model's device (a constant with ``loss.new_full``): a host number here would be a blocking
    host-to-device copy on every step, so it is refused."""
    for k in keys:
        if not torch.is_tensor(terms[k]):
            raise TypeError(f"the objective's term {k!r} is a {type(terms[k]).__name__}, not a tensor on the device")
    return torch.stack([terms[k].detach().float() for k in keys])
