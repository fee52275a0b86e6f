"""Which dataset rows make each optimizer step's batch, for map-style sources: seeded per-epoch
permutations, sliced per step and per rank (:mod:`nclip.data.loader`'s docstring)."""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np
import torch

from nclip.errors import NclipError


class StepBatches(torch.utils.data.Sampler):
    """Lists of (step, dataset index) keys: this rank's share of every global batch, from
    ``start_step`` on.

    ``group`` > 1 keeps the dataset's groups of consecutive indices [g·j, g·j + g) whole inside a
    global batch (hard-negative groups of synthetic scenes): groups are shuffled, not samples.
    """

    def __init__(self, length: int, batch_size: int, steps: int, seed: int, start_step: int = 0,
                 rank: int = 0, world_size: int = 1, group: int = 1):
        if batch_size % world_size:
            raise NclipError(f"batch size {batch_size} is not divisible by the world size {world_size}")
        if batch_size % group:
            raise NclipError(f"batch size {batch_size} is not divisible by the group size {group}")
        self.length, self.batch, self.steps, self.seed = length, batch_size, steps, seed
        self.start, self.rank, self.world, self.group = start_step, rank, world_size, group
        self._perm: tuple[int, np.ndarray | None] = (-1, None)  # (epoch, its permutation)

    def epoch(self, step: int) -> int:
        """The epoch of ``step``: the permutation its global batch is a slice of (an epoch is
        ⌊length / batch⌋ steps); below one global batch of data every step draws anew, its own epoch."""
        units, per_batch = self.length // self.group, self.batch // self.group
        return step if units < per_batch else step // (units // per_batch)

    def global_batch(self, step: int) -> np.ndarray:
        """Dataset indices of the global batch of ``step``: consecutive slices of per-epoch
        permutations (an epoch is ⌊length / batch⌋ steps; the remainder is dropped)."""
        g = self.group
        units, per_batch = self.length // g, self.batch // g  # whole groups only
        if units < per_batch:  # tiny datasets: sample with replacement
            picked = np.random.default_rng([self.seed, step]).integers(0, max(units, 1), per_batch)
        else:
            epoch, pos = self.epoch(step), step % (units // per_batch)
            if self._perm[0] != epoch:  # one permutation per epoch, not per step (1M rows: ~10 ms)
                self._perm = epoch, np.random.default_rng([self.seed, epoch]).permutation(units)
            perm = self._perm[1]
            picked = perm[pos * per_batch : (pos + 1) * per_batch]
        if g == 1:
            return picked
        return (picked[:, None] * g + np.arange(g)).ravel()

    def __iter__(self) -> Iterator[list[int]]:
        local = self.batch // self.world
        for step in range(self.start, self.steps):
            idx = self.global_batch(step)[self.rank * local : (self.rank + 1) * local].tolist()
            yield [(step, i) for i in idx]  # keys: the two views are seeded by the step

    def __len__(self) -> int:
        return self.steps - self.start

    def repeats_warning(self, what: str) -> str | None:
        """A one-line warning when a global batch must repeat rows (a dataset smaller than a batch:
        rows are then drawn with replacement), naming the largest batch without repeats; None
        otherwise. A repeated image–text pair is a false negative for InfoNCE (its twin's caption
        counts as a negative) and weighs twice in nCLIP's batch mean p̄."""
        units, per_batch = self.length // self.group, self.batch // self.group
        if units >= per_batch:
            return None
        step = math.lcm(self.world, self.group)  # a batch splits evenly over ranks and keeps groups whole
        largest = self.length // step * step
        fix = f"; the largest batch without repeats is {largest} (--set train.batch_size={largest})" if largest >= 2 \
            else ""
        return (f"train.batch_size {self.batch} is larger than the {self.length} training samples of {what}: every "
                f"batch repeats samples, and a repeated pair is a false negative for contrastive objectives{fix}")
