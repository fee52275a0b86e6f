"""The normalisation of a conv image tower (``model.vision.norm``): BatchNorm as built, or one without
batch statistics, the standard remedies where batch statistics break exactness.

Exact accumulation (:mod:`nclip.train.accumulate`) runs the towers micro-batch by micro-batch, so a
BatchNorm inside a tower normalises each micro-batch by its own statistics: the step is then exact in
everything but that normalisation. Two normalisations compute each image on its own, and with them
the k-micro-batch step equals the whole-batch step to float rounding:

- ``group``: GroupNorm over groups of channels (Wu & He 2018), gcd(32, C) groups, started from the
  BatchNorm's affine parameters (CLIP's modified ResNet starts each residual branch's last γ at 0);
- ``frozen_batch``: BatchNorm that always normalises with its running statistics and never updates
  them (the usual way to fine-tune a pretrained detector or CLIP ResNet: ``--init`` brings the
  statistics). From scratch the statistics stay 0 and 1, so the layer is its affine part alone.
"""

from __future__ import annotations

import math

from torch import nn

TOWER_NORMS = ("batch", "group", "frozen_batch")


class FrozenStatsBatchNorm2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` held in eval mode: running statistics used, never updated; γ and β train.
    The same state-dict keys as the plain layer, so pretrained weights load as they are."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.training = False  # nn.Module starts in training mode without calling train()

    def train(self, mode: bool = True) -> FrozenStatsBatchNorm2d:
        return super().train(False)


def _group_norm(bn: nn.BatchNorm2d) -> nn.GroupNorm:
    channels = bn.num_features
    gn = nn.GroupNorm(math.gcd(32, channels), channels, eps=bn.eps, affine=bn.affine,
                      device=bn.weight.device if bn.affine else None, dtype=bn.weight.dtype if bn.affine else None)
    if bn.affine:
        gn.weight.data.copy_(bn.weight.data)
        gn.bias.data.copy_(bn.bias.data)
    return gn


def _frozen(bn: nn.BatchNorm2d) -> FrozenStatsBatchNorm2d:
    frozen = FrozenStatsBatchNorm2d(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats)
    frozen.load_state_dict(bn.state_dict())
    return frozen.to(next(iter(bn.state_dict().values())).device)


def set_tower_norm(tower: nn.Module, norm: str) -> nn.Module:
    """``tower`` with every ``nn.BatchNorm2d`` replaced for ``norm`` (in place; "batch": unchanged)."""
    if norm not in TOWER_NORMS:
        raise ValueError(f"unknown tower norm {norm!r}; expected one of {', '.join(TOWER_NORMS)}")
    if norm == "batch":
        return tower
    make = _group_norm if norm == "group" else _frozen
    for name, child in tower.named_children():
        if type(child) is nn.BatchNorm2d:
            setattr(tower, name, make(child))
        else:
            set_tower_norm(child, norm)
    return tower
