"""From a data source to this rank's batches of (pixels, token ids, attention mask) for training.

Map-style sources (synthetic, digits, csv, folder) are step-based and deterministic: the global batch of
optimizer step t holds dataset indices drawn from a seeded permutation, and each index's
augmentation is seeded by (seed, index), so a run resumed at step t sees exactly the data an
uninterrupted run would have. Under distribution, rank r takes the r-th contiguous slice of every
global batch, so gathering the ranks' rows restores the global batch in order.

Streamed sources (webdataset tar shards) are endless per-rank, per-worker streams; see
:mod:`nclip.data.webdataset` for how they split, shuffle, mix and resume exactly. Pixels are uint8,
normalised where the step runs (:mod:`nclip.data.device_feed`); workers: :mod:`nclip.data.workers`.

What an objective needs beyond pixels, ids and mask comes from its class (``Objective.views``,
``Objective.label_request``), passed by the trainer:

- ``views=2`` (CMSF, MSF, SupCon...): pixels [B, 2, 3, S, S], the strong (online) view first, the
  weak (target) view second (:mod:`nclip.data.views`). The collate function (in the loader's
  workers) crops both views as uint8 from the un-augmented images and draws the strong view's
  colour parameters, row by row from (seed, step, row of the *global* batch): a resumed run and a run
  split over ranks see exactly the views of an uninterrupted single-process run. Batches for a
  device (``train_loader(..., device=...)``: the trainer's) carry these :class:`ViewCrops`, which
  :class:`nclip.data.device_feed.DeviceFeed` finishes there (colours, normalisation); without a
  device the loader finishes them itself, on the CPU, with the same function: the floats a
  ``DeviceFeed`` on the CPU hands out. Map-style sources only (built-in, CSV and folder).
- labels (built-in sources, a ``folder`` tree, a CSV with ``data.csv_label_key``: see
  :func:`nclip.defaults.has_labels`): two more per-row tensors, the training label of the requested kind
  and the clean one, the batch's ``labels`` and ``true_labels`` (:class:`nclip.batch.Batch`). Label noise is
  :func:`nclip.data.label_noise.corrupt_labels` over the whole training split (the exact share,
  seeded by the run seed, fixed for the run, as the paper's Sec. 2.2), computed from dataset
  indices alone so that no sample has to be generated up front; the semi-supervised setting keeps
  the label of a seeded ``labelled`` share of the rows and gives the rest -1. The clean label of a
  ``folder``/CSV row is its class label itself.
- ``data.tagging`` (xCLIP Sec. 4.3): a row's caption is a template filled with its class name, drawn
  by (seed, epoch of the step, index): :mod:`nclip.data.tagging`.
- several captions per image (CSV/JSONL and WebDataset sources): ``data.caption_choice`` picks the
  caption a step sees, drawn by (seed, epoch of the step, index), or with ``all`` gives every caption,
  the batch's ids and mask then [B, C, L] with ``caption_valid`` [B, C]: :mod:`nclip.data.captions`.
- hard negative captions (``data.hard_negative_key`` of a CSV/JSONL file or of shard samples'
  ``.json``, or ``data.hard_negatives: swap`` made from the caption a step sees): N more text slots
  per image after the captions, ids and mask [B, C + N, L] with ``negative_valid`` [B, N]:
  :mod:`nclip.data.hard_negatives`.

:func:`train_loader` returns a :class:`TrainData`: iterate it for batches; ``skipped`` counts the
bad samples skipped so far on this rank (named on stderr as they are, and summed up at the end of the
batches: :mod:`nclip.data.bad_samples`) and ``state()`` is the data position to checkpoint.
"""

from __future__ import annotations

import sys
from typing import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from nclip.batch import Batch
from nclip.config import RunConfig
from nclip.data.bad_samples import BadWindow, SkipLog, first_good
from nclip.data.captions import choose, count_summary, slot_rows
from nclip.data.hard_negatives import swap_caption, text_slots
from nclip.data.label_noise import RowLabels
from nclip.data.labels import label_kind, tag_captions
from nclip.data.shards import Bad
from nclip.data.sources import build_dataset
from nclip.data.step_batches import StepBatches
from nclip.data.tagging import TagCaptions
from nclip.data.tokenization import CaptionTokenizer
from nclip.data.transforms import augment, to_uint8_tensor
from nclip.data.types import Sample
from nclip.data.views import ViewCrops, ViewRecipe, crop_views, finish_views
from nclip.data.workers import loader_options, loader_workers, worker_message
from nclip.defaults import BUILTIN_SOURCES, has_labels
from nclip.errors import NclipError
from nclip.objectives.base import LabelRequest
from nclip.objectives.functional import UNLABELLED

_AUG_STREAM = 0xA06  # separates augmentation randomness from the data generators' streams
_VIEW_STREAM = 0x71E5  # two views


class Tagged:
    """The tagging caption of a row of a step-indexed source (:mod:`nclip.data.tagging`): the
    template is drawn by the epoch of the step, as the sampler counts epochs (``epoch_of``)."""

    def __init__(self, captions: TagCaptions, key: str, epoch_of):
        self.captions, self.key, self.epoch_of = captions, key, epoch_of

    def __call__(self, step: int, index: int, class_id: int) -> str:
        return self.captions(self.epoch_of(step), index, class_id)


class StepCaptions:
    """The caption(s) a step sees of a step-indexed source's row (:func:`nclip.data.captions.choose`):
    ``random`` draws by (seed, epoch of the step, index), as the sampler counts epochs (``epoch_of``)."""

    def __init__(self, choice: str, seed: int, epoch_of):
        self.choice, self.seed, self.epoch_of = choice, seed, epoch_of

    def __call__(self, step: int, index: int, captions: tuple[str, ...]) -> str | tuple[str, ...]:
        return choose(captions, self.choice, [self.seed, self.epoch_of(step), index])


class TrainPairs(Dataset):
    """Key (step, index) → (augmented image, uint8 [3, S, S], caption, bad, labels, step, index); see
    :class:`Collate`.

    ``raw``: the un-augmented image instead (uint8 [H, W, 3]), from which the collate function crops
    two views; ``labels``: (train, true) of the ``label_key`` kind by :class:`RowLabels`; ``tags``:
    the tagging captions instead of the samples' own."""

    def __init__(self, samples: Sequence[Sample], cfg: RunConfig, raw: bool = False,
                 labels: RowLabels | None = None, label_key: str | None = None, tags: Tagged | None = None):
        self.samples, self.cfg, self.raw, self.labels, self.label_key = samples, cfg, raw, labels, label_key
        self.tags = tags

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key) -> tuple:
        step, index = key
        if hasattr(self.samples, "read"):  # a folder's images may be bad: skipped (nclip.data.bad_samples)
            s, _, bad = first_good(index, len(self.samples), self.samples.read, self.samples.where_of)
        else:  # built-in samples are never bad
            s, bad = self.samples[index], []
        if self.raw:
            image = s.image
        else:
            rng = np.random.default_rng([self.cfg.seed, _AUG_STREAM, index])
            image = to_uint8_tensor(augment(s.image, self.cfg.data.image_size, self.cfg.data.augment, rng))
        labels = self.labels(index, s.labels[self.label_key]) if self.labels is not None else None
        caption = self.tags(step, index, s.labels[self.tags.key]) if self.tags is not None else s.caption
        return image, caption, bad, labels, step, index


class _Keyed(Dataset):
    """A CSV source's (image, captions, bad, row read) items read by sampler keys, as
    :class:`TrainPairs`'s items, the caption chosen by ``captions`` (:class:`StepCaptions`).
    ``class_ids`` [N]: the rows' labels (of the row actually read: a bad row is replaced by the next
    good one), for ``labels`` (:class:`RowLabels`, by the requested index) and ``tags``;
    ``unlabelled``: every row's (train, true) labels are :data:`UNLABELLED` (a source without labels
    for an objective whose labels are optional); ``negatives``: every row's hard negatives, then the
    items' seventh element (those of the row read)."""

    def __init__(self, dataset: Dataset, captions: StepCaptions, unlabelled: bool = False,
                 class_ids: np.ndarray | None = None, labels: RowLabels | None = None, tags: Tagged | None = None,
                 negatives: list[tuple[str, ...]] | None = None):
        self.dataset, self.fixed = dataset, (UNLABELLED, UNLABELLED) if unlabelled else None
        self.captions, self.class_ids, self.labels, self.tags = captions, class_ids, labels, tags
        self.negatives = negatives

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key) -> tuple:
        step, index = key
        image, captions, bad, row = self.dataset[index]
        caption = self.captions(step, index, captions)
        labels = self.fixed
        if self.labels is not None:
            labels = self.labels(index, int(self.class_ids[row]))
        if self.tags is not None:
            caption = self.tags(step, index, int(self.class_ids[row]))
        if self.negatives is not None:
            return image, caption, bad, labels, step, index, self.negatives[row]
        return image, caption, bad, labels, step, index


def _kept(cfg: RunConfig, rows, n: int) -> np.ndarray:
    """Dataset indices of the training split that are not in ``data.exclude`` (the identifiers
    ``nclip data dedup`` writes: image paths for CSV and folder sources, ``source:train:i`` for
    built-in data), so that evaluation images never leak into pre-training."""
    from nclip.data.dedup import load_exclusions

    excluded = load_exclusions(cfg.data.exclude)
    if cfg.data.source in BUILTIN_SOURCES:
        ids = (f"{cfg.data.source}:train:{i}" for i in range(n))
    else:  # a CSV's resolved image paths, a folder's files
        ids = (str(p) for p in (rows if cfg.data.source == "csv" else rows.paths))
    kept = np.asarray([i for i, name in enumerate(ids) if name not in excluded], dtype=np.int64)
    if len(kept) == 0:
        raise NclipError(f"data.exclude {cfg.data.exclude} leaves no training sample")
    return kept


class _Excluding(Dataset):
    """A keyed dataset restricted to the dataset indices ``kept``: the sampler draws positions in
    ``kept``, items keep their own dataset index (labels, noise and frozen embeddings follow it)."""

    def __init__(self, dataset: Dataset, kept: np.ndarray):
        self.dataset, self.kept = dataset, kept

    def __len__(self) -> int:
        return len(self.kept)

    def __getitem__(self, key) -> tuple:
        step, position = key
        return self.dataset[(step, int(self.kept[position]))]


class Collate:
    """List of (image, caption, bad[, labels, step, index]) → (:class:`~nclip.batch.Batch`, info): pixels
    uint8 [B, 3, S, S], ids and mask [B, L], and ``labels``/``true_labels`` [B] when the items carry
    (train, true) labels, ``index`` [B] (the samples' dataset indices) when ``with_index``; ``info["bad"]``
    lists the (where, reason) of the samples skipped in favour of these.

    ``views``: a :class:`nclip.data.views.ViewRecipe`; the images are then un-augmented uint8
    [H, W, 3] and pixels become their :class:`nclip.data.views.ViewCrops` (finished by
    :func:`nclip.data.views.finish_views`), row i drawn as row ``rank`` × B + i of the step's global
    batch, seeded by (seed, step). ``slots`` (``data.caption_choice: all``): the items' captions are
    tuples, padded to ``slots`` per image: ids and mask [B, slots, L], ``caption_valid`` [B, slots].
    ``negatives`` (hard negatives: :mod:`nclip.data.hard_negatives`): N negative slots per image after
    the caption slots, ids and mask [B, C + N, L] and ``negative_valid`` [B, N]; the negatives are the
    items' seventh element, or with ``swap`` the swap of each item's (first) caption, seeded by
    (seed, dataset index)."""

    def __init__(self, tokenizer: CaptionTokenizer, views: ViewRecipe | None = None, seed: int = 0, rank: int = 0,
                 with_index: bool = False, slots: int | None = None, negatives: int | None = None,
                 swap: bool = False):
        self.tokenizer, self.views, self.seed, self.rank = tokenizer, views, seed, rank
        self.with_index, self.slots, self.negatives, self.swap = with_index, slots, negatives, swap

    def _negatives_of(self, item) -> tuple[str, ...]:
        if not self.swap:
            return item[6]
        caption = item[1] if isinstance(item[1], str) else item[1][0]
        swapped = swap_caption(caption, self.seed, item[5])
        return () if swapped is None else (swapped,)

    def __call__(self, items) -> tuple[Batch, dict]:
        images, captions, bad = zip(*(item[:3] for item in items))
        valid = negative_valid = None
        if self.negatives is not None:
            flat, valid, negative_valid = text_slots(list(captions), [self._negatives_of(item) for item in items],
                                                     self.slots, self.negatives)
            ids, mask = (t.reshape(len(items), -1, t.shape[-1]) for t in self.tokenizer(flat))
        elif self.slots is None:
            ids, mask = self.tokenizer(list(captions))
        else:
            flat, valid = slot_rows(list(captions), self.slots)
            ids, mask = (t.reshape(len(items), self.slots, -1) for t in self.tokenizer(flat))
        if self.views is None:
            pixels = torch.stack(images)
        else:
            b, step = len(items), items[0][4]
            pixels = crop_views(images, self.views, (self.seed, _VIEW_STREAM, step), first_row=self.rank * b)
        batch = Batch(pixels, ids, mask)
        if valid is not None:
            batch.caption_valid = torch.from_numpy(valid)
        if negative_valid is not None:
            batch.negative_valid = torch.from_numpy(negative_valid)
        if len(items[0]) > 3 and items[0][3] is not None:
            labels = torch.tensor([item[3] for item in items], dtype=torch.long)  # [B, 2]
            batch.labels, batch.true_labels = labels[:, 0], labels[:, 1]
        if self.with_index:
            batch.index = torch.tensor([item[5] for item in items], dtype=torch.long)
        return batch, {"bad": [b for group in bad for b in group]}


class TrainData:
    """This rank's batches from ``start_step`` to ``train.steps``, the count of bad samples skipped
    (restored on resume) and the data position (:meth:`state`) for checkpoints. ``finish``: two views'
    :class:`ViewCrops` are finished here (on the CPU) instead of by a :class:`DeviceFeed`."""

    lookahead = True  # a batch depends on its step alone: the next may be read before a step runs

    def __init__(self, loader: DataLoader, kind: str, steps: int, cfg: RunConfig, world_size: int,
                 what: str, skipped: int = 0, streams: list[list[int]] | None = None, finish: bool = True):
        self.loader, self.kind, self.steps, self.world, self.what = loader, kind, steps, world_size, what
        self.finish = finish
        self._skipped = skipped  # map-style sources
        self.size: int | None = None  # samples of a map-style source (None: streamed)
        # {"captions": ..., "negatives": ...} per image ({min, mean, max}) of a CSV/JSONL file: what it read
        self.text_counts: dict = {}
        # streamed sources: [records consumed, bad skipped, *per-source consumed (data.sampling per_source)]
        self.streams = streams or []
        self._window = BadWindow(cfg.data.bad_window, cfg.data.max_bad_fraction)  # map-style: checked here
        self.skip_log = SkipLog(what)

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

    def __iter__(self) -> Iterator[Batch]:
        """This rank's batches, with the per-row labels when asked for."""
        it = iter(self.loader)
        for _ in range(self.steps):
            try:
                batch, info = next(it)
            except StopIteration:
                return
            except NclipError as e:  # raised in a loader worker: keep the one-line message
                raise NclipError(worker_message(e)) from None
            if self.kind == "map":
                self._account_map(len(batch), info["bad"])
            else:
                self.streams[info["stream"]] = [int(info["consumed"]), int(info["skipped"]),
                                                *(int(n) for n in info.get("sources", ()))]
            self.skip_log.add(info.get("bad", ()))
            if self.finish and isinstance(batch.pixels, ViewCrops):
                batch = batch.with_pixels(finish_views(batch.pixels))
            yield batch
        if (summary := self.skip_log.summary()) is not None:
            print(summary, file=sys.stderr, flush=True)

    def _account_map(self, good: int, bad: list) -> None:
        self._skipped += len(bad)
        for where, reason in bad:
            self._window.add(Bad("", where, reason), self.what)
        for _ in range(good):
            self._window.add(None, self.what)


def slot_counts(cfg: RunConfig, pairs=None) -> tuple[int | None, int | None]:
    """(caption slots, hard negative slots) per image of a batch, each None where the run has none.
    Caption slots: under ``data.caption_choice: all``, ``data.captions_per_image``, else the most captions
    of any row of the CSV/JSONL file. Negative slots: one swap negative, or ``data.negatives_per_image``,
    else the most negatives of any row of the file. The file is read once, where a count needs it and
    ``pairs`` (its :class:`nclip.data.csv_source.CsvTrainPairs`) is not given; the config makes
    WebDataset name both counts."""
    d = cfg.data
    captions = d.captions_per_image if d.caption_choice == "all" else None
    negatives = 1 if d.hard_negatives == "swap" else d.negatives_per_image
    count_captions = d.caption_choice == "all" and captions is None
    count_negatives = d.hard_negative_key is not None and negatives is None
    if count_captions or count_negatives:
        if pairs is None:
            from nclip.data.csv_source import CsvTrainPairs

            pairs = CsvTrainPairs(cfg)
        captions = pairs.slots if count_captions else captions
        negatives = pairs.negative_slots if count_negatives else negatives
    return captions, negatives


def train_loader(cfg: RunConfig, tokenizer: CaptionTokenizer, start_step: int = 0,
                 rank: int = 0, world_size: int = 1, state: dict | None = None, views: int = 1,
                 labels: LabelRequest | None = None, device: torch.device | str | None = None) -> TrainData:
    """This rank's training data from ``start_step`` on; ``state`` is the data position saved in
    the checkpoint being resumed (see :meth:`TrainData.state`); ``views`` and ``labels``: what the
    objective needs (module docstring); ``device``: where the batches go (CUDA: pinned, auto workers),
    given by a caller that hands them to a :class:`DeviceFeed`: two views then stay
    :class:`ViewCrops` for the feed to finish on that device (None: finished here, on the CPU)."""
    workers = {"num_workers": loader_workers(cfg, device)}  # resolved once: the webdataset streams see it
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update=workers)})
    d = cfg.data
    if cfg.train.batch_size % world_size:
        raise NclipError(f"train.batch_size {cfg.train.batch_size} is not divisible by the world size {world_size}")
    if views not in (1, 2):
        raise NclipError(f"{views} views per image are not supported (1 or 2)")
    if (views == 2 or labels is not None) and d.source == "webdataset":
        need = "two views per image" if views == 2 else "labels"
        raise NclipError(f"data.source webdataset cannot give this objective {need} yet; use a csv or built-in source")
    local = cfg.train.batch_size // world_size
    steps = cfg.train.steps - start_step
    workers = loader_options(d.num_workers, device, seed=cfg.seed)
    if d.source == "webdataset":
        from nclip.data.webdataset import ShardStreamDataset

        slots, negatives = slot_counts(cfg)
        collate = Collate(tokenizer, slots=slots, negatives=negatives)
        ds = ShardStreamDataset(cfg, collate, local, rank, world_size, start_step)
        ds.plan_resume(state, d.exact_resume)
        loader = DataLoader(ds, batch_size=None, **workers)
        return TrainData(loader, "stream", steps, cfg, world_size, "data.shards", streams=ds.initial_streams())
    if labels is not None and not labels.optional:
        label_kind(cfg, labels.key)  # raises for a source without labels, before any image is read
    want = labels if labels is not None and has_labels(d) else None  # optional labels of unlabelled data: -1
    tagging = tag_captions(cfg)
    if d.source == "csv":
        from nclip.data.csv_source import CsvTrainPairs

        pairs = CsvTrainPairs(cfg, raw=views == 2)
        n = len(pairs)
    else:
        samples = build_dataset(cfg, "train")
        n = len(samples)
        if n == 0:
            raise NclipError("the training dataset is empty")
    kept = _kept(cfg, pairs.images if d.source == "csv" else samples, n) if d.exclude else None
    sampler = StepBatches(n if kept is None else len(kept), cfg.train.batch_size, cfg.train.steps, cfg.seed,
                          start_step, rank, world_size, d.hard_negative_group)  # group > 1: synthetic only
    if rank == 0 and (warning := sampler.repeats_warning(d.csv if d.source == "csv" else d.folder or d.source)):
        print(f"nclip: warning: {warning}", file=sys.stderr, flush=True)
    row_labels, key = None, None
    if want is not None:
        key, space = label_kind(cfg, want.key)
        row_labels = RowLabels(n, len(space), want, cfg.seed)
    tags = Tagged(*tagging, sampler.epoch) if tagging is not None else None
    if d.source == "csv":
        dataset = _Keyed(pairs, StepCaptions(d.caption_choice, cfg.seed, sampler.epoch),
                         unlabelled=labels is not None and want is None, class_ids=pairs.labels,
                         labels=row_labels, tags=tags, negatives=pairs.negative_sets)
        what = d.csv
    else:
        dataset = TrainPairs(samples, cfg, raw=views == 2, labels=row_labels, label_key=key, tags=tags)
        what = d.folder if d.source == "folder" else d.source
    if kept is not None:
        dataset = _Excluding(dataset, kept)
    recipe = ViewRecipe(d.image_size, crop_scale=tuple(d.augment.crop_scale)) if views == 2 else None
    slots, negatives = slot_counts(cfg, pairs if d.source == "csv" else None)
    collate = Collate(tokenizer, recipe, cfg.seed, rank, with_index=labels is not None and labels.frozen is not None,
                      slots=slots, negatives=negatives, swap=d.hard_negatives == "swap")
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, **workers)
    skipped = int(state.get("skipped", 0)) if state and state.get("kind") == "map" else 0
    data = TrainData(loader, "map", steps, cfg, world_size, what, skipped=skipped, finish=device is None)
    data.size = n if kept is None else len(kept)  # training rows, for the start-up block
    if d.source == "csv":  # captions and negatives per row, for the start-up block
        data.text_counts = {"captions": count_summary([len(c) for c in pairs.caption_sets])}
        if pairs.negative_sets is not None:
            data.text_counts["negatives"] = count_summary([len(c) for c in pairs.negative_sets])
    return data
