"""The skip-on-non-finite decision, kept on the device: a step that logs nothing never waits on the host.

A step whose loss or gradient is not finite on any rank is skipped on every rank: weights,
optimizer state and buffers stay as they were (:mod:`nclip.train.loop`). Reading that decision on
the host (``bool(flag)``) would make the host wait for the step's last kernel every step, so it
stays a 0-d float tensor on the device, ``skip`` (1: skip), and every consumer is gated by it there:

- the optimizer update, inside the fused AdamW and SGD kernels through their ``found_inf``
  argument: the mechanism ``torch.amp``'s GradScaler uses (the kernel leaves parameters and moments
  untouched and takes back its step count). Fused kernels exist on CUDA and on the CPU, so the
  CPU runs the same code path as a GPU. An optimizer without ``found_inf`` (torchao's
  ``adamw8bit``) reads the flag on the host, once per step (docs/runs.md says so);
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

# optimizers whose fused update takes ``found_inf`` (torch.optim's Adam, AdamW, SGD)
_FOUND_INF = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def supports_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, _FOUND_INF) and all(g.get("fused") for g in optimizer.param_groups)


class StepGate:
    """The device-side skip decision of every step, the gated optimizer update and the skip counters."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device, counters: dict[str, int]):
        self.optimizer, self.device = optimizer, device
        self.on_device = supports_found_inf(optimizer)
        # [in total, in a row], as float so that arithmetic with the float flag needs no casts
        self.skips = torch.tensor([float(counters.get("nonfinite_total", 0)), float(counters.get("nonfinite_row", 0))],
                                  device=device)

    def decide(self, nonfinite_loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """``skip`` (0-d float, 1 or 0): any rank's loss or gradient norm was not finite. One no-grad
        all-reduce of one value under torchrun, no host read."""
        local = ((nonfinite_loss > 0) | ~torch.isfinite(grad_norm)).float().reshape(1)
        return (collectives.all_reduce_sum_no_grad(local) > 0).float().reshape(())

    def step(self, skip: torch.Tensor) -> None:
        """The optimizer update, unless ``skip``; counts the skip."""
        opt = self.optimizer
        if self.on_device:
            _init_momentum_buffers(opt)
            opt.grad_scale, opt.found_inf = None, skip  # read by the fused kernels (torch.amp's protocol)
            try:
                opt.step()
            finally:
                del opt.grad_scale, opt.found_inf
        elif not bool(skip):  # no found_inf in this optimizer: the host decides (one read per step)
            opt.step()
        total, row = self.skips.unbind()
        self.skips = torch.stack([total + skip, (row + skip) * skip])

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
