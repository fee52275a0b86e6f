"""From a data source to this rank's batches of (pixels, token ids, attention mask) for training.

Map-style sources (synthetic, digits, csv) are step-based and deterministic: the global batch of
optimizer step t holds dataset indices drawn from a seeded permutation, and each index's
augmentation is seeded by (seed, index), so a run resumed at step t sees exactly the data an
uninterrupted run would have. Under distribution, rank r takes the r-th contiguous slice of every
global batch, so gathering the ranks' rows restores the global batch in order.

Streamed sources (webdataset tar shards) are endless per-rank, per-worker streams; see
:mod:`nclip.data.webdataset` for how they split, shuffle, mix and resume exactly.

:func:`train_loader` returns a :class:`TrainData`: iterate it for batches; ``skipped`` counts the
bad samples skipped so far on this rank and ``state()`` is the data position to checkpoint.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from nclip.config import RunConfig
from nclip.data.shards import Bad
from nclip.data.tokenization import CaptionTokenizer
from nclip.data.transforms import augment, resize_center_crop, to_tensor
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
            hard_negative_group=d.hard_negative_group if split == "train" else 1,
        )
    if d.source == "digits":
        from nclip.data.digits import DigitsPairs

        return DigitsPairs(split=split, seed=cfg.seed, image_size=d.image_size)
    if d.source in ("webdataset", "csv"):
        raise NclipError(f"data.source {d.source} has no built-in {split!r} split with labels; evaluate "
                         "on a built-in dataset or your own evaluation set instead")
    raise NclipError(f"unknown data source {d.source!r}")  # pragma: no cover - validated


class TrainPairs(Dataset):
    """Sample i → (augmented image tensor [3, S, S], caption)."""

    def __init__(self, samples: Sequence[Sample], cfg: RunConfig):
        self.samples, self.cfg = samples, cfg

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, str, list]:
        s = self.samples[index]
        aug = self.cfg.data.augment
        rng = np.random.default_rng([self.cfg.seed, _AUG_STREAM, index])
        image = augment(s.image, self.cfg.data.image_size, aug, rng)
        return to_tensor(image), s.caption, []  # built-in samples are never bad


class StepBatches(torch.utils.data.Sampler):
    """Index lists of this rank's share of every global batch, from ``start_step`` on.

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

    def global_batch(self, step: int) -> np.ndarray:
        """Dataset indices of the global batch of ``step``: consecutive slices of per-epoch
        permutations (an epoch is ⌊length / batch⌋ steps; the remainder is dropped)."""
        g = self.group
        units, per_batch = self.length // g, self.batch // g  # whole groups only
        if units < per_batch:  # tiny datasets: sample with replacement
            picked = np.random.default_rng([self.seed, step]).integers(0, max(units, 1), per_batch)
        else:
            epoch, pos = divmod(step, units // per_batch)
            perm = np.random.default_rng([self.seed, epoch]).permutation(units)
            picked = perm[pos * per_batch : (pos + 1) * per_batch]
        if g == 1:
            return picked
        return (picked[:, None] * g + np.arange(g)).ravel()

    def __iter__(self) -> Iterator[list[int]]:
        local = self.batch // self.world
        for step in range(self.start, self.steps):
            idx = self.global_batch(step)
            yield idx[self.rank * local : (self.rank + 1) * local].tolist()

    def __len__(self) -> int:
        return self.steps - self.start


class Collate:
    """List of (image, caption, bad) → (pixels [B, 3, S, S], ids [B, L], mask [B, L], info), where
    ``bad`` lists the (where, reason) of samples skipped in favour of this one."""

    def __init__(self, tokenizer: CaptionTokenizer):
        self.tokenizer = tokenizer

    def __call__(self, items):
        images, captions, bad = zip(*items)
        ids, mask = self.tokenizer(list(captions))
        return torch.stack(images), ids, mask, {"bad": [b for group in bad for b in group]}


class TrainData:
    """This rank's batches from ``start_step`` to ``train.steps``, the count of bad samples skipped
    (restored on resume) and the data position (:meth:`state`) for checkpoints."""

    def __init__(self, loader: DataLoader, kind: str, steps: int, cfg: RunConfig, world_size: int,
                 what: str, skipped: int = 0, streams: list[list[int]] | None = None):
        self.loader, self.kind, self.steps, self.world, self.what = loader, kind, steps, world_size, what
        self._skipped = skipped  # map-style sources
        self.streams = streams or []  # streamed sources: [records consumed, bad skipped] per stream
        from nclip.data.webdataset import BadWindow

        self._window = BadWindow(cfg.data.bad_window, cfg.data.max_bad_fraction)

    @property
    def skipped(self) -> int:
        """Bad samples skipped on this rank since the start of the run."""
        return self._skipped if self.kind == "map" else sum(s[1] for s in self.streams)

    def state(self) -> dict:
        if self.kind == "map":
            return {"kind": "map", "skipped": self._skipped}
        return {"kind": "stream", "world_size": self.world, "streams": [list(s) for s in self.streams]}

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        it = iter(self.loader)
        for _ in range(self.steps):
            try:
                pixels, ids, mask, info = next(it)
            except StopIteration:
                return
            except NclipError as e:  # raised in a loader worker: keep the one-line message
                raise NclipError(_worker_message(e)) from None
            if self.kind == "map":
                self._account_map(pixels.shape[0], info["bad"])
            else:
                self.streams[info["stream"]] = [int(info["consumed"]), int(info["skipped"])]
            yield pixels, ids, mask

    def _account_map(self, good: int, bad: list) -> None:
        self._skipped += len(bad)
        for where, reason in bad:
            self._window.add(Bad("", where, reason), self.what)
        for _ in range(good):
            self._window.add(None, self.what)


def _worker_message(e: Exception) -> str:
    """The original one-line message of an error re-raised by a DataLoader worker."""
    text = str(e)
    if "Original Traceback" not in text:
        return text
    last = [line for line in text.strip().splitlines() if line.strip()][-1]
    return last.split("NclipError: ", 1)[-1]


def train_loader(cfg: RunConfig, tokenizer: CaptionTokenizer, start_step: int = 0,
                 rank: int = 0, world_size: int = 1, state: dict | None = None) -> TrainData:
    """This rank's training data from ``start_step`` on; ``state`` is the data position saved in
    the checkpoint being resumed (see :meth:`TrainData.state`)."""
    d = cfg.data
    if cfg.train.batch_size % world_size:
        raise NclipError(f"train.batch_size {cfg.train.batch_size} is not divisible by the world size {world_size}")
    local = cfg.train.batch_size // world_size
    steps = cfg.train.steps - start_step
    workers = dict(num_workers=d.num_workers, persistent_workers=False)
    if d.source == "webdataset":
        from nclip.data.webdataset import ShardStreamDataset

        ds = ShardStreamDataset(cfg, Collate(tokenizer), local, rank, world_size, start_step)
        ds.plan_resume(state, d.exact_resume)
        loader = DataLoader(ds, batch_size=None, **workers)
        return TrainData(loader, "stream", steps, cfg, world_size, "data.shards", streams=ds.initial_streams())
    if d.source == "csv":
        from nclip.data.csv_source import CsvTrainPairs

        dataset, what = CsvTrainPairs(cfg), d.csv
    else:
        samples = build_dataset(cfg, "train")
        if len(samples) == 0:
            raise NclipError("the training dataset is empty")
        dataset, what = TrainPairs(samples, cfg), d.source
    sampler = StepBatches(len(dataset), cfg.train.batch_size, cfg.train.steps, cfg.seed, start_step, rank,
                          world_size, d.hard_negative_group)  # > 1 only for synthetic scenes (validated)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=Collate(tokenizer), **workers)
    skipped = int(state.get("skipped", 0)) if state and state.get("kind") == "map" else 0
    return TrainData(loader, "map", steps, cfg, world_size, what, skipped=skipped)


def eval_tensor(image: np.ndarray, size: int) -> torch.Tensor:
    """Evaluation pre-processing of one image: resize + centre crop + normalise."""
    return to_tensor(resize_center_crop(image, size))
