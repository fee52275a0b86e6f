"""An exponential moving average of the model's weights (``train.ema``: the decay, 0 = off).

After every optimizer step that is *taken*, each trainable parameter θ of the model moves its
average θ̄ by θ̄ ← d·θ̄ + (1 − d)·θ (d = ``train.ema``, e.g. 0.999), in one
``torch._foreach_lerp_`` call whose weight (1 − d)·taken is a 0-d device tensor: a step the gate
skipped (:mod:`nclip.train.gate`, ``taken`` = 0) leaves θ̄ bitwise as it was, with no host read. The
weight goes in as a list of tensors (the ``List`` overload, each parameter's lerp reading its weight
on the device): the ``Scalar`` overload takes a number, and a 0-d tensor given there is read with
``item()``, a host sync every step on CUDA. On the CPU both compute the same lerp bitwise; on CUDA
the list overload runs one lerp kernel per parameter instead of one fused multi-tensor kernel (PyTorch
has no foreach lerp with a device-scalar weight), which queues launches but never waits. The
average starts from the weights the run starts from (its initialisation, or ``model.init``).

Why not ``torch.optim.swa_utils.AveragedModel`` with ``get_ema_multi_avg_fn``: its update reads a
counter on the host every step (``if n_averaged == 0``), has no way to leave a skipped step out
without that host read, and keeps a deep copy of the whole model (frozen towers and buffers
included). Its multi-tensor path is ``_foreach_lerp_`` with a number weight (the fused kernel on
CUDA); ``benchmarks/ema_update.py`` measures both on the CPU (docs/runs.md).

Buffers (BatchNorm statistics, ...) are not averaged: the EMA model uses the live buffers. A copy
taken after every taken step would always equal them (a skipped step puts the buffers back), so
none is kept. Frozen parameters (a locked tower, CMSF's momentum target) are the live ones too.

Every rank holds the same average: the weights are the same on every rank after each step (DDP),
and every rank applies the same gate. Not supported with ``train.strategy: fsdp`` (refused by the
config). The average is in every checkpoint (``state.pt``, key ``ema``), so resume is exact.

The API for evaluation code (the end-of-run eval, periodic evaluation during training)::

    from nclip.train.ema import swapped_to_ema
    with swapped_to_ema(model, ema):   # ema: a WeightEMA, or None (then nothing is swapped)
        results = evaluate(model)      # the model now holds the averaged weights
    # the trained weights are back, bitwise

The swap copies in place (one copy of the trainable weights, no second model) and is undone even
if the body raises; the average itself is untouched by it (a checkpoint may be written inside).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn


class WeightEMA:
    """θ̄ of ``model``'s trainable parameters (those with ``requires_grad`` when built)."""

    def __init__(self, model: nn.Module, decay: float):
        if not 0 < decay < 1:
            raise ValueError(f"EMA decay {decay} is not in (0, 1)")
        self.decay = decay
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        # detached views of the parameters, made once: they share storage, so they see every
        # in-place optimizer update, and the step's hot path builds no list
        self.params = [p.detach() for _, p in named]
        self.dtypes = [p.dtype for p in self.params]
        with torch.no_grad():
            self.averages = [p.clone() for p in self.params]

    @torch.no_grad()
    def update(self, taken: torch.Tensor | float = 1.0) -> None:
        """θ̄ ← θ̄ + w·(θ − θ̄), w = (1 − d)·taken; ``taken`` a 0-d device tensor (1 or 0), never read
        on the host. With w = 0 (a skipped step) θ̄ + 0·(θ − θ̄) is θ̄ exactly."""
        if not self.params:
            return
        if not torch.is_tensor(taken):
            taken = torch.full((), float(taken), device=self.params[0].device)
        weight = (taken * (1.0 - self.decay)).to(self.params[0].dtype)
        by_dtype = {dtype: weight.to(dtype) for dtype in set(self.dtypes)}  # lerp's weight has its input's dtype
        torch._foreach_lerp_(self.averages, self.params, [by_dtype[d] for d in self.dtypes])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """{parameter name: θ̄} (for the checkpoint's state.pt)."""
        return dict(zip(self.names, self.averages))

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.names if n not in state]
        if missing:
            raise ValueError(f"the checkpoint's EMA has no {missing[0]} ({len(missing)} parameters missing)")
        for name, avg in zip(self.names, self.averages):
            avg.copy_(state[name])

    @torch.no_grad()
    def copy_to_model(self) -> list[torch.Tensor]:
        """Put θ̄ into the model's parameters; returns their trained values (for :meth:`restore`)."""
        held = [p.clone() for p in self.params]
        torch._foreach_copy_(self.params, self.averages)
        return held

    @torch.no_grad()
    def restore(self, held: list[torch.Tensor]) -> None:
        torch._foreach_copy_(self.params, held)


def ema_for(model: nn.Module, decay: float, state: dict | None = None) -> WeightEMA | None:
    """The run's EMA (None when ``decay`` is 0), restored from a checkpoint's ``state`` when it
    holds one (a run resumed with ``train.ema`` newly set starts its average from the weights)."""
    if not decay:
        return None
    ema = WeightEMA(model, decay)
    if state is not None and state.get("ema") is not None:
        ema.load_state_dict(state["ema"])
    return ema


def ema_state(ema: WeightEMA | None) -> dict:
    """The checkpoint's entry: ``{"ema": {name: θ̄}}``, or nothing without an EMA."""
    return {} if ema is None else {"ema": ema.state_dict()}


@contextlib.contextmanager
def swapped_to_ema(model: nn.Module, ema: WeightEMA | None) -> Iterator[nn.Module]:
    """``model`` with the averaged weights inside the block, its own weights back after it (even
    on an exception). ``ema`` None: the model as it is. ``model`` must be the module ``ema`` was
    built on (the parameters are swapped in place, so wrappers around it see the swap too)."""
    if ema is None:
        yield model
        return
    held = ema.copy_to_model()
    try:
        yield model
    finally:
        ema.restore(held)


def save_run_models(model: nn.Module, cfg, run_dir, ema: WeightEMA | None) -> None:
    """The run's model: ``RUN/model`` (the averaged weights when ``train.ema`` is on) and, with an
    EMA, the trained (raw) weights beside it in ``RUN/model-raw``. Rank 0."""
    from pathlib import Path

    from nclip.jsonio import writing
    from nclip.models.io import save_model

    run_dir = Path(run_dir)
    if ema is not None:
        with writing(run_dir / "model-raw"):
            save_model(model, cfg, run_dir / "model-raw")
    with swapped_to_ema(model, ema), writing(run_dir / "model"):
        save_model(model, cfg, run_dir / "model")


def evaluate_with_ema(evaluate, model: nn.Module, ema: WeightEMA | None) -> dict:
    """``evaluate(model)`` of the raw weights, and with an EMA the same of the averaged weights under
    ``ema/`` keys (``ema/zeroshot/scenes/top1`` beside ``zeroshot/scenes/top1``) and ``ema/decay``."""
    results = dict(evaluate(model))
    if ema is not None:
        with swapped_to_ema(model, ema):
            results.update({f"ema/{k}": v for k, v in evaluate(model).items()})
        results["ema/decay"] = ema.decay
    return results
