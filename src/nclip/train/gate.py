"""The skip-on-non-finite decision, kept on the device: a step that logs nothing never waits on the host.

A step whose loss or gradient is not finite on any rank is skipped on every rank: weights,
optimizer state and buffers stay as they were (:func:`nclip.train.step.optimizer_step`). Reading that decision on
the host (``bool(flag)``) would make the host wait for the step's last kernel every step, so it
stays a 0-d float tensor on the device, ``skip`` (1: skip), and every consumer is gated by it there:

- the optimizer update, inside the fused AdamW and SGD kernels through their ``found_inf``
  argument: the mechanism ``torch.amp``'s GradScaler uses (the kernel leaves parameters and moments
  untouched and takes back its step count). Fused kernels exist on CUDA and on the CPU, so the
  CPU runs the same code path as a GPU. ``adamw8bit`` (:mod:`nclip.train.lowbit`) reads the same
  attribute. An optimizer without it (a non-fused torch optimizer, which nclip builds only for
  parameters on several devices) reads the flag on the host, once per step;
- the loss scale of ``train.precision: fp16`` (:mod:`nclip.train.loss_scale`): the optimizer
  divides the gradients by it (``grad_scale``), and it backs off after a skipped step and grows
  after a run of taken ones, on the device;
- the buffers the forward changed (BatchNorm statistics, objective queues and centres):
  :meth:`nclip.train.snapshot.BufferSnapshot.restore_where`;
- the objective's ``after_step`` (CMSF's momentum update), which gets ``taken`` = 1 − skip;
- the counters of skipped steps (in total, in a row), device tensors read only where the loop
  syncs anyway: at log and checkpoint steps (:meth:`StepGate.counters`). A streak of
  ``train.max_nonfinite_steps`` is therefore noticed at the next log step.
"""

from __future__ import annotations

import torch

from nclip import distributed as collectives
from nclip.train.loss_scale import loss_scale_for

# optimizers whose fused update takes ``found_inf`` (torch.optim's Adam, AdamW, SGD)
_FOUND_INF = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def supports_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Does the update take ``found_inf`` and ``grad_scale`` on the device? torch's fused Adam, AdamW
    and SGD, and nclip's ``adamw8bit`` (which says so with ``reads_found_inf``)."""
    if getattr(optimizer, "reads_found_inf", False):
        return True
    return isinstance(optimizer, _FOUND_INF) and all(g.get("fused") for g in optimizer.param_groups)


class StepGate:
    """The device-side skip decision of every step, the gated optimizer update, the skip counters
    and, when the towers autocast to float16 (``amp``), the loss scale (``loss_scale``; None: no
    scaling), restored from a checkpoint's ``state`` when it holds one."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device, counters: dict[str, int],
                 amp: torch.dtype | None = None, state: dict | None = None):
        self.optimizer, self.device = optimizer, device
        self.loss_scale = loss_scale_for(amp, device, state)
        self.on_device = supports_found_inf(optimizer)
        # [in total, in a row], as float so that arithmetic with the float flag needs no casts
        self.skips = torch.tensor([float(counters.get("nonfinite_total", 0)), float(counters.get("nonfinite_row", 0))],
                                  device=device)

    def update(self, keys: list[str], terms: torch.Tensor, nonfinite_loss: torch.Tensor,
               clip: float | None) -> tuple[list[str], torch.Tensor, torch.Tensor, torch.Tensor]:
        """The gated update of a step whose backward is done: the term names and values to log
        (:meth:`logged`, taken before the loss scale moves), the gradient norm (clipped to ``clip``),
        the decision every rank takes, and the optimizer update unless it is ``skip``. Returns
        (keys, terms, grad_norm, skip), all on the device."""
        keys, terms = self.logged(keys, terms)
        grad_norm = self.grad_norm(clip)
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a replicated DTensor
            grad_norm = grad_norm.full_tensor()
        skip = self.decide(nonfinite_loss, grad_norm)
        self.step(skip)
        return keys, terms, grad_norm, skip

    def decide(self, nonfinite_loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """``skip`` (0-d float, 1 or 0): any rank's loss or gradient norm was not finite. One no-grad
        all-reduce of one value under torchrun, no host read."""
        local = ((nonfinite_loss > 0) | ~torch.isfinite(grad_norm)).float().reshape(1)
        return (collectives.all_reduce_sum_no_grad(local) > 0).float().reshape(())

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to back-propagate: times the loss scale under fp16, else itself."""
        return loss if self.loss_scale is None else self.loss_scale.scaled(loss)

    def unscaled(self, norm: torch.Tensor) -> torch.Tensor:
        """The norm of the gradients, given that of the gradients as the backward left them."""
        return norm if self.loss_scale is None else self.loss_scale.unscaled(norm)

    def grad_norm(self, clip: float | None) -> torch.Tensor:
        """The norm of the step's gradients (of every parameter the optimizer updates), which are
        then clipped to ``clip`` (``train.grad_clip``; None: the norm alone, no gradient rescaled by 1).
        Under fp16 the backward left S·g: ‖S·g‖ / S is ‖g‖ exactly (S a power of two), and S·g
        clipped with it is, after the update's division by S, the bits of g clipped."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        norm = self.unscaled(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))
        if clip:
            torch.nn.utils.clip_grads_with_norm_(params, clip, norm)
        return norm

    def logged(self, keys: list[str], terms: torch.Tensor) -> tuple[list[str], torch.Tensor]:
        """The step's term names and values, with ``loss_scale`` under fp16: the S this step's backward
        used (a copy, taken before :meth:`step` updates it)."""
        if self.loss_scale is None:
            return keys, terms
        return [*keys, "loss_scale"], torch.cat([terms, self.loss_scale.scale.reshape(1).to(terms.dtype)])

    def step(self, skip: torch.Tensor) -> None:
        """The optimizer update, unless ``skip``, on gradients divided by the loss scale; counts the
        skip and updates the loss scale."""
        opt = self.optimizer
        grad_scale = None if self.loss_scale is None else self.loss_scale.scale
        if self.on_device:
            _init_momentum_buffers(opt)
            opt.grad_scale, opt.found_inf = grad_scale, skip  # read by the fused kernels (torch.amp's protocol)
            try:
                opt.step()
            finally:
                del opt.grad_scale, opt.found_inf
        elif not bool(skip):  # no found_inf in this optimizer: the host decides (one read per step)
            if grad_scale is not None:
                torch._foreach_div_([p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None],
                                    grad_scale)
            opt.step()
        if self.loss_scale is not None:
            self.loss_scale.update(skip)
        total, row = self.skips.unbind()
        self.skips = torch.stack([total + skip, (row + skip) * skip])

    def checkpoint_state(self) -> dict:
        """What a checkpoint's state keeps of the gate besides the counters: the loss scale, if any."""
        return {} if self.loss_scale is None else {"loss_scale": self.loss_scale.state_dict()}

    def counters(self) -> dict[str, int]:
        """{"nonfinite_total", "nonfinite_row"} as ints: a host read, for log and checkpoint steps."""
        total, row = self.skips.tolist()
        return {"nonfinite_total": int(total), "nonfinite_row": int(row)}


def _init_momentum_buffers(optimizer: torch.optim.Optimizer) -> None:
    """Fused SGD allocates its momentum buffers uninitialised on the first step and fills them in
    the kernel, which a skipped step (``found_inf``) never runs: start them at zero instead. With
    no dampening (nclip's SGD) a zero buffer gives the first step's buffer, the gradient, exactly."""
    if not isinstance(optimizer, torch.optim.SGD):
        return
    for group in optimizer.param_groups:
        if not group.get("momentum"):
            continue
        for p in group["params"]:
            state = optimizer.state[p]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
