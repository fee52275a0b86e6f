"""From a dataset of Samples to batches of (pixels, token ids, attention mask) for training.

Step-based and deterministic: the global batch of optimizer step t holds dataset indices drawn
from a seeded permutation, and each index's augmentation is seeded by (seed, index), so a run
resumed at step t sees exactly the data an uninterrupted run would have. Under distribution, rank r
takes the r-th contiguous slice of every global batch, so gathering the ranks' rows restores the
global batch in order.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from nclip.config import RunConfig
from nclip.data.tokenization import CaptionTokenizer
from nclip.data.transforms import random_resized_crop, resize_center_crop, to_tensor
from nclip.data.types import Sample
from nclip.errors import NclipError

_AUG_STREAM = 0xA06  # separates augmentation randomness from the data generators' streams


def build_dataset(cfg: RunConfig, split: str, length: int | None = None) -> Sequence[Sample]:
    """A built-in dataset (synthetic scenes or digits) for ``split``."""
    d = cfg.data
    if d.source == "synthetic":
        from nclip.data.synthetic import SyntheticScenes

        return SyntheticScenes(
            split=split,
            length=length or d.train_length,
            seed=cfg.seed,
            image_size=d.image_size,
            max_objects=d.max_objects,
            loose_caption_prob=d.loose_caption_prob if split == "train" else 0.0,
        )
    if d.source == "digits":
        from nclip.data.digits import DigitsPairs

        return DigitsPairs(split=split, seed=cfg.seed, image_size=d.image_size)
    raise NclipError(f"unknown data source {d.source!r}")  # pragma: no cover - validated


class TrainPairs(Dataset):
    """Sample i → (augmented image tensor [3, S, S], caption)."""

    def __init__(self, samples: Sequence[Sample], cfg: RunConfig):
        self.samples, self.cfg = samples, cfg

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, str]:
        s = self.samples[index]
        aug = self.cfg.data.augment
        rng = np.random.default_rng([self.cfg.seed, _AUG_STREAM, index])
        image = random_resized_crop(s.image, self.cfg.data.image_size, aug.crop_scale, aug.crop_ratio, rng)
        if aug.horizontal_flip and rng.random() < 0.5:
            image = image[:, ::-1]
        return to_tensor(image), s.caption


class StepBatches(torch.utils.data.Sampler):
    """Index lists of this rank's share of every global batch, from ``start_step`` on."""

    def __init__(self, length: int, batch_size: int, steps: int, seed: int, start_step: int = 0,
                 rank: int = 0, world_size: int = 1):
        if batch_size % world_size:
            raise NclipError(f"batch size {batch_size} is not divisible by the world size {world_size}")
        self.length, self.batch, self.steps, self.seed = length, batch_size, steps, seed
        self.start, self.rank, self.world = start_step, rank, world_size

    def global_batch(self, step: int) -> np.ndarray:
        """Dataset indices of the global batch of ``step``: consecutive slices of per-epoch
        permutations (an epoch is ⌊length / batch⌋ steps; the remainder is dropped)."""
        per_epoch = max(self.length // self.batch, 1)
        epoch, pos = divmod(step, per_epoch)
        perm = np.random.default_rng([self.seed, epoch]).permutation(self.length)
        if self.length < self.batch:  # tiny datasets: sample with replacement
            return np.random.default_rng([self.seed, step]).integers(0, self.length, self.batch)
        return perm[pos * self.batch : (pos + 1) * self.batch]

    def __iter__(self) -> Iterator[list[int]]:
        local = self.batch // self.world
        for step in range(self.start, self.steps):
            idx = self.global_batch(step)
            yield idx[self.rank * local : (self.rank + 1) * local].tolist()

    def __len__(self) -> int:
        return self.steps - self.start


class Collate:
    """List of (image, caption) → (pixels [B, 3, S, S], ids [B, L], mask [B, L])."""

    def __init__(self, tokenizer: CaptionTokenizer):
        self.tokenizer = tokenizer

    def __call__(self, items):
        images, captions = zip(*items)
        ids, mask = self.tokenizer(list(captions))
        return torch.stack(images), ids, mask


def train_loader(cfg: RunConfig, tokenizer: CaptionTokenizer, start_step: int = 0,
                 rank: int = 0, world_size: int = 1) -> DataLoader:
    samples = build_dataset(cfg, "train")
    if len(samples) == 0:
        raise NclipError("the training dataset is empty")
    sampler = StepBatches(len(samples), cfg.train.batch_size, cfg.train.steps, cfg.seed, start_step, rank, world_size)
    return DataLoader(
        TrainPairs(samples, cfg),
        batch_sampler=sampler,
        collate_fn=Collate(tokenizer),
        num_workers=cfg.data.num_workers,
        persistent_workers=cfg.data.num_workers > 0,
    )


def eval_tensor(image: np.ndarray, size: int) -> torch.Tensor:
    """Evaluation pre-processing of one image: resize + centre crop + normalise."""
    return to_tensor(resize_center_crop(image, size))
