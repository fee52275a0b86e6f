"""Cheap discrete choices: ``Picker`` buffers a numpy ``Generator``'s uniform draws.

One numpy call per ~64 choices instead of one per choice: the per-call overhead of numpy's
Generator dominates the generation time otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class Picker:
    """Uniform draws from a buffered ``numpy.random.Generator`` (deterministic given the rng)."""

    def __init__(self, rng: np.random.Generator, block: int = 64):
        self._rng, self._block = rng, block
        self._buf: list[float] = []
        self._pos = 0

    def uniform(self) -> float:
        if self._pos == len(self._buf):
            self._buf, self._pos = self._rng.random(self._block).tolist(), 0
        self._pos += 1
        return self._buf[self._pos - 1]

    def chance(self, p: float) -> bool:
        return self.uniform() < p

    def index(self, n: int) -> int:
        return min(int(self.uniform() * n), n - 1)

    def choice(self, seq: Sequence):
        return seq[self.index(len(seq))]

    def sample(self, seq: Sequence, k: int) -> list:
        """k distinct items of ``seq`` in random order (partial Fisher–Yates)."""
        items = list(seq)
        for j in range(k):
            r = j + self.index(len(items) - j)
            items[j], items[r] = items[r], items[j]
        return items[:k]
