"""Which labelled images fine-tuning trains on, validates on and tests on.

The dataset's own test split (:mod:`nclip.eval.datasets`: digits' held-out digits, the synthetic
test scenes, a folder tree's ``test/`` or seeded 30 %) is only ever used for the final number.
From its training split, :func:`label_splits` first holds out a stratified validation split
(``val_fraction`` of every class; it chooses the learning rate and the epoch), then draws the
``fraction`` of the labels that fine-tuning sees from the rest (Tab. 6's 1 % and 10 % rows):

- class-balanced: every class contributes ``fraction · n_c`` (rounded half up) of its ``n_c`` remaining
  images, and at least one, so a 1 % draw of a 10-class set still has every class;
- seeded: the same ``seed`` draws the same images, and a draw at a smaller fraction is a subset of
  one at a larger fraction (each class's images are permuted once and the draw is a prefix);
- disjoint from validation by construction (drawn from what validation left).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nclip.errors import NclipError
from nclip.eval.metrics import stratified_split


@dataclass(frozen=True)
class LabelSplits:
    """Row indices into the dataset's training split: ``train`` (the fraction fine-tuned on) and
    ``val`` (held out for the lr and epoch choice), both sorted; ``pool``: the rows ``train`` was
    drawn from (training split minus validation)."""

    train: np.ndarray
    val: np.ndarray
    pool: np.ndarray


def label_splits(labels: np.ndarray, fraction: float, val_fraction: float, seed: int) -> LabelSplits:
    """See the module docstring; ``labels`` [N] are the training split's class indices."""
    if not 0.0 < fraction <= 1.0:
        raise NclipError(f"finetune: fraction must lie in (0, 1], got {fraction}")
    y = np.asarray(labels, dtype=np.int64)
    pool, val = (t.numpy() for t in stratified_split(torch.from_numpy(y), val_fraction, seed))
    if len(val) == 0:
        raise NclipError(f"finetune: the training split ({len(y)} images) is too small to hold out a validation "
                         f"split of {val_fraction:.0%} per class")
    rng = np.random.default_rng([int(seed), 0xF1AE])
    chosen = []
    for c in np.unique(y[pool]):
        rows = pool[y[pool] == c]
        rows = rows[rng.permutation(len(rows))]
        chosen.append(rows[: max(1, int(fraction * len(rows) + 0.5))])  # rounded half up
    return LabelSplits(np.sort(np.concatenate(chosen)), np.sort(val), np.sort(pool))


def per_class_counts(labels: np.ndarray, rows: np.ndarray, num_classes: int) -> list[int]:
    """Images per class among ``rows`` (for the results and the tests)."""
    return np.bincount(np.asarray(labels)[rows], minlength=num_classes).tolist()
