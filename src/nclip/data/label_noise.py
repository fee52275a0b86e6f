"""Synthetic label noise for the noisy supervised setting of CMSF (Sec. 2.2: "the labels for a certain
percentage of images are corrupted randomly and kept constant throughout training"; 5, 10, 25 and
50 % on ImageNet-100, Fig. 3 and Tab. A3)."""

from __future__ import annotations

import math

import numpy as np
import torch

from nclip.objectives.base import LabelRequest
from nclip.objectives.functional import UNLABELLED

_NOISE_STREAM, _SEMI_STREAM = 0x4015E, 0x5E41  # label noise, labelled rows


def corrupt_labels(labels: torch.Tensor, rate: float, num_classes: int, seed: int) -> torch.Tensor:
    """A copy of ``labels`` [n] in which exactly round(rate·n) rows (half rounds up) carry another class.

    The rows are a uniformly random subset of that size and each gets a class drawn uniformly from the
    num_classes − 1 classes other than its own, so a corrupted row never keeps its true label and the
    realised noise rate is ``rate`` up to the rounding of rate·n (a fixed count, not a per-row coin
    flip whose realised rate would vary). The result depends only on (labels, rate, num_classes,
    seed): draw it once before training and keep it, as the paper does.
    """
    labels = torch.as_tensor(labels)
    if labels.ndim != 1 or labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"labels must be a 1-D integer tensor, got {labels.dtype} {tuple(labels.shape)}")
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"rate must be in [0, 1], got {rate}")
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2 to corrupt a label into another class, got {num_classes}")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes}), got [{int(labels.min())}, {int(labels.max())}]")
    n = labels.shape[0]
    count = math.floor(rate * n + 0.5)
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(n, generator=g)[:count]  # [count]
    shift = torch.randint(1, num_classes, (count,), generator=g)  # uniform over the other classes
    out = labels.clone()
    out[rows.to(labels.device)] = (labels[rows.to(labels.device)] + shift.to(labels.device, labels.dtype)) % num_classes
    return out


def _int_seed(*parts: int) -> int:
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0])


class RowLabels:
    """Training and clean labels of the rows of a training split of ``n`` samples, per
    :class:`LabelRequest`: ``(train, true)`` for a row's index and clean label.

    The noise is :func:`corrupt_labels` applied to the whole split: it draws the corrupted rows and
    their class shifts from (n, rate, classes, seed) alone, so the shift of every row is computed
    here once (from a vector of zeros) and added to a row's clean label when the row is read.
    """

    def __init__(self, n: int, num_classes: int, request: LabelRequest, seed: int):
        self.classes = num_classes
        self.shift = None
        if request.noise > 0:
            self.shift = corrupt_labels(torch.zeros(n, dtype=torch.long), request.noise, num_classes,
                                        seed=_int_seed(seed, _NOISE_STREAM))  # [n]: 0 = kept
        self.labelled = None
        if request.labelled < 1:
            g = torch.Generator().manual_seed(_int_seed(seed, _SEMI_STREAM))
            self.labelled = torch.zeros(n, dtype=torch.bool)
            self.labelled[torch.randperm(n, generator=g)[: math.floor(request.labelled * n + 0.5)]] = True

    def __call__(self, index: int, true: int) -> tuple[int, int]:
        train = true if self.shift is None else (true + int(self.shift[index])) % self.classes
        if self.labelled is not None and not bool(self.labelled[index]):
            train = UNLABELLED
        return train, true
