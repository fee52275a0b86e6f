"""The dynamic loss scale of ``train.precision: fp16``, kept on the device.

fp16 has 5 bits of exponent: gradients below 2^-24 flush to zero in the towers' half-precision
backward. The loss is multiplied by a scale S before the backward, so the gradients that reach
the (float32) parameters are S·g; S is a power of two, so the scaling is exact. The same S
is then taken out without a pass of its own (Micikevicius et al., "Mixed Precision Training", 2018;
``torch.amp.GradScaler``'s rule and state):

- the update: the fused AdamW / SGD kernels (and ``adamw8bit``, :mod:`nclip.train.lowbit`) divide
  the gradients by ``grad_scale`` = S as they read them, the protocol ``torch.amp`` uses;
- the gradient norm, for clipping and logging: ‖S·g‖ / S, which is ‖g‖ exactly (a power of two
  moves the exponent only; squares, sum and square root commute with it), so clipping the scaled
  gradients with the unscaled norm gives, after the kernel's division, the bits an unscaled clip
  would;
- whether the step is skipped: the run's device-side gate (:mod:`nclip.train.gate`), the same one
  that skips any step whose loss or gradient is not finite. An overflow of S·g is such a step.

After every step S is updated on the device by ``torch._amp_update_scale_`` (GradScaler's kernel):
halved after a skipped step, doubled after ``GROWTH_INTERVAL`` taken steps in a row. S and the
count of taken steps go into the checkpoint, so a resumed run continues with the same bits.
"""

from __future__ import annotations

import torch

# torch.amp.GradScaler's defaults
INIT_SCALE = 2.0**16
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2000


def loss_scale_for(amp: torch.dtype | None, device: torch.device, state: dict | None) -> LossScale | None:
    """The loss scale of a run whose towers autocast to ``amp`` (None unless float16), from a
    checkpoint's ``state`` when it holds one."""
    if amp != torch.float16:
        return None
    return LossScale(device, (state or {}).get("loss_scale"))


class LossScale:
    """S (0-d float32) and the taken steps since it last changed (0-d int32), on ``device``."""

    def __init__(self, device: torch.device, state: dict | None = None):
        self.scale = torch.full((), INIT_SCALE, dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        if state is not None:
            self.load_state_dict(state)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to back-propagate: S·loss."""
        return loss * self.scale

    def unscaled(self, norm: torch.Tensor) -> torch.Tensor:
        """The norm of the gradients from that of the scaled ones: exact (S is a power of two)."""
        return norm / self.scale

    def update(self, skip: torch.Tensor) -> None:
        """Back off after a skipped step (``skip`` 1), grow after ``GROWTH_INTERVAL`` taken ones;
        on the device, no host read."""
        torch._amp_update_scale_(self.scale, self.growth_tracker, skip.float(), GROWTH_FACTOR, BACKOFF_FACTOR,
                                 GROWTH_INTERVAL)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"scale": self.scale.cpu().clone(), "growth_tracker": self.growth_tracker.cpu().clone()}

    def load_state_dict(self, state: dict) -> None:
        self.scale.copy_(state["scale"])
        self.growth_tracker.copy_(state["growth_tracker"])
