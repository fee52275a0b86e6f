"""Which computation runs in which precision (see docs/precision.md).

The towers and heads may run under bf16 or fp16 autocast (``train.precision``); everything that turns
their outputs into a number we optimise or report runs in float32. fp16 (for GPUs without bf16) keeps
10 bits of mantissa but only 5 of exponent: its gradients underflow unless the loss is scaled
(:mod:`nclip.train.loss_scale`). bf16 keeps 8 bits of mantissa: a loss
near 0.64 can only take steps of 1/256, and an entropy near ln 32768 = 10.4 steps of 1/16, so
softmaxes over thousands of prototypes, the batch mean p̄ and the entropies of nCLIP come out
plausible and quietly wrong. :func:`to_float32` is the one place where model outputs are cast, used
where they meet an objective (:class:`nclip.train.step.TrainStep`, ProtoCLIP's episode extraction) and
where evaluation collects them (:mod:`nclip.eval.features`).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

HALF = (torch.float16, torch.bfloat16)


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of the towers for ``train.precision`` on ``device`` (None: float32).
    ``auto``: bf16 on a CUDA device that has it (Ampere and later), fp16 on one without (T4, V100:
    bf16 would be emulated), float32 elsewhere."""
    if precision == "bf16":
        return torch.bfloat16
    if precision == "fp16":
        return torch.float16
    if precision == "auto" and device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    return None


def tower_autocast(device: torch.device, dtype: torch.dtype | None):
    """The context the towers and heads run in: autocast to ``dtype``, or nothing for float32."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def to_float32(x):
    """``x`` with every half-precision tensor cast to float32: a tensor, a dict, a list or tuple, or
    a dataclass such as :class:`nclip.objectives.base.EncoderOutput` (a new object; float32 and
    integer tensors are returned as they are). The cast is differentiable."""
    if torch.is_tensor(x):
        return x.float() if x.dtype in HALF else x
    if isinstance(x, dict):
        return {k: to_float32(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(to_float32(v) for v in x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{f.name: to_float32(getattr(x, f.name)) for f in dataclasses.fields(x)})
    return x
