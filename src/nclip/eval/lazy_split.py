"""A split that is read only when a protocol asks for it: the probe (train) split of a benchmark
copy (``wds:``'s ``train/``, ``imagefolder:``'s sibling ``train/``) is indexed the first time a
linear or k-NN probe needs it, so a zero-shot-only evaluation of ImageNet never lists its 1.28M
training images."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable


class LazySplit(Sequence):
    """``factory()`` (a Sequence of samples) built on first use; a problem in it (a damaged shard,
    a missing folder) is then the one-line error of its reader."""

    def __init__(self, factory: Callable[[], Sequence]):
        self._factory, self._samples = factory, None

    @property
    def samples(self) -> Sequence:
        if self._samples is None:
            self._samples = self._factory()
        return self._samples

    @property
    def label_kinds(self):
        return getattr(self.samples, "label_kinds", {})

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]
