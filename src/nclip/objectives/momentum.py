"""The momentum (target) encoder: exponential moving average of the online encoder's weights.

CMSF Sec. 2: "the target encoder is updated as a slowly moving average of the online encoder:
θf ← mθf + (1 − m)θg where m is close to 1" (m = 0.99 for CMSF, Sec. 2.1.2), the momentum idea of
MoCo; BYOL (Grill et al., 2020, Sec. 3.2) raises m from its base value to 1 along a cosine.
"""

from __future__ import annotations

import math

import torch
from torch import nn

SCHEDULES = ("constant", "cosine")


@torch.no_grad()
def momentum_update(target_module: nn.Module, online_module: nn.Module, m: float,
                    taken: torch.Tensor | None = None) -> None:
    """θf ← m·θf + (1 − m)·θg for every parameter, in place; buffers (BatchNorm statistics) are copied.

    ``taken``: a 0-d tensor on the device, 0 after a skipped optimizer step: then nothing changes,
    bitwise (decided on the device, without a host read: :mod:`nclip.train.gate`). None: always update.

    The two modules must have the same parameter and buffer names and shapes (f is a copy of g).
    m = 1 leaves the parameters unchanged, m = 0 copies them.

    A few kernels per dtype, not a few per tensor (a ResNet-50 has ~320 tensors): the tensors of a
    dtype are concatenated, updated with the same elementwise ops as one tensor at a time (so the
    values are identical), gated with one ``torch.where`` and copied back with one ``_foreach_copy_``.
    """
    if not 0.0 <= m <= 1.0:
        raise ValueError(f"momentum m must be in [0, 1], got {m}")
    pairs: list[tuple[torch.Tensor, torch.Tensor, bool]] = []  # (target, online, is a parameter)
    for kind, target, online in (
            ("parameters", dict(target_module.named_parameters()), dict(online_module.named_parameters())),
            ("buffers", dict(target_module.named_buffers()), dict(online_module.named_buffers()))):
        if target.keys() != online.keys():
            diff = sorted(target.keys() ^ online.keys())
            raise ValueError(f"target and online modules have different {kind}: {diff[:3]}")
        for name, t in target.items():
            o = online[name]
            if t.shape != o.shape:
                raise ValueError(f"{name}: target shape {tuple(t.shape)} != online shape {tuple(o.shape)}")
            pairs.append((t, o, kind == "parameters"))
    groups: dict[tuple[torch.dtype, bool], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for t, o, is_param in pairs:
        groups.setdefault((t.dtype, is_param), []).append((t, o))
    for (_, is_param), group in groups.items():
        _update_group(group, m if is_param else None, taken)


def _update_group(group: list[tuple[torch.Tensor, torch.Tensor]], m: float | None, taken: torch.Tensor | None) -> None:
    """t ← where(taken, m·t + (1 − m)·o, t) for the (target, online) pairs of one dtype (m None: a copy
    of o, the buffers' update), as one flat tensor."""
    targets = [t for t, _ in group]
    old = torch.cat([t.reshape(-1) for t in targets])
    online = torch.cat([o.detach().reshape(-1).to(old.dtype) for _, o in group])
    new = online if m is None else (old * m).add_(online, alpha=1.0 - m)  # as (t * m).add_(o, alpha=1 - m)
    if taken is not None:
        new = torch.where(taken.bool(), new, old)
    torch._foreach_copy_(targets, [x.view(t.shape) for x, t in zip(new.split([t.numel() for t in targets]), targets)])


def momentum_at(step: int, total: int, base: float = 0.99, schedule: str = "constant") -> float:
    """The momentum m at ``step`` of ``total`` steps.

    ``constant``: m = base (CMSF Sec. 2.1.2: 0.99). ``cosine`` (BYOL Sec. 3.2):
    m = 1 − (1 − base)·(cos(π·step/total) + 1)/2, from base at step 0 to 1 at step = total; steps
    past ``total`` stay at 1.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if not 0.0 <= base <= 1.0:
        raise ValueError(f"base momentum must be in [0, 1], got {base}")
    if total <= 0 or step < 0:
        raise ValueError(f"need total > 0 and step >= 0, got step={step}, total={total}")
    if schedule == "constant":
        return base
    return 1.0 - (1.0 - base) * (math.cos(math.pi * min(step, total) / total) + 1.0) / 2.0
