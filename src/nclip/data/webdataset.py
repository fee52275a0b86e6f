"""Streaming training data from WebDataset tar shards: weighted sources, rank/worker splits,
shuffle buffer, resampling, bad-sample accounting, and an exact, decode-free resume.

One *stream* per (rank, loader worker) produces this rank's local batches. A stream is a pure
function of (seed, rank, stream id) and is built in three stages, all on raw (undecoded) records:

1. per source, an endless sequence of shards: drawn with replacement (``data.resampled: true``,
   the default: no epochs, every rank/worker independent) or, without resampling, this stream's
   slice ``shards[slot::slots]`` (slot = rank · workers + stream) in a fresh permutation per pass;
2. the sources mixed *per sample* with probabilities ∝ ``weight`` (so the mix holds whatever the
   shard sizes);
3. a shuffle buffer of ``data.shuffle_buffer`` records.

``data.sampling: per_source`` (xCLIP Tab. 9f, "debiased sampling, where each batch is sampled from a
single data source") replaces stage 2: the global batch of step ``s`` comes whole from source
:func:`batch_source` (seed, s), drawn with probabilities ∝ ``weight`` from the seed and the step
alone, so every rank and worker picks the same source and a resumed run the same sequence; each
stream keeps one shuffled record sequence per source (stages 1 and 3 per source) and fills its
share of the batch from the chosen one, and counts its position in every source for resume.

Records are then decoded (Pillow), checked (image decodes, caption non-empty) and augmented with
randomness seeded by (seed, rank, stream, record number), their caption chosen among a sample's
several (``data.caption_choice``, :mod:`nclip.data.captions`) from the same, and collated into batches of
``batch_size / world_size`` good pairs. Bad records are skipped and counted; if more than
``data.max_bad_fraction`` of a window of ``data.bad_window`` records is bad, the stream stops with
an :class:`NclipError` naming the shard most of them came from.

Exclusion (``data.exclude``, e.g. the ``duplicates.json`` of ``nclip data dedup --target SHARDS``):
records whose sample key is listed are dropped as they stream by, before stage 2, so they are
neither decoded nor counted as consumed, and the replay below stays exact.

Resume: every batch carries (stream id, records consumed, bad records so far). The trainer keeps
the latest of each stream and checkpoints them. On resume each stream replays stages 1-3 for its
consumed count *without decoding a single image* and continues exactly where it stopped, so a
resumed run sees the very batches an uninterrupted one would have (``data.exact_resume``; off, or
with a different world size or worker count, the streams are re-seeded from the resume step
instead: valid data, different order). Batch ``b`` of a DataLoader comes from worker ``b mod W``;
stream ids are rotated by the resume step so that step ``s`` is always served by stream ``s mod W``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from nclip.config import RunConfig
from nclip.data.bad_samples import BadWindow
from nclip.data.captions import choose
from nclip.data.hard_negatives import record_negatives, swap_caption
from nclip.data.shards import Bad, Record, check_shards, decode_captions, expand_shards, iter_records
from nclip.data.transforms import augment, to_uint8_tensor
from nclip.errors import NclipError

_STREAM_TAG = 0x5EED5  # separates the shard/mix/shuffle draws from other users of the seed
_AUG_TAG = 0xA06
_BATCH_SOURCE_TAG = 0xB5C  # the per-step source draw of data.sampling per_source


@dataclass(frozen=True)
class Source:
    name: str
    urls: tuple[str, ...]
    weight: float


def sources_from_config(cfg: RunConfig) -> list[Source]:
    """The configured shard sources, expanded and checked (missing local shards are an error)."""
    d = cfg.data
    if d.sources is not None:
        specs = [(f"data.sources[{i}]", s.shards, s.weight) for i, s in enumerate(d.sources)]
    else:
        specs = [("data.shards", d.shards, 1.0)]
    return [Source(name, tuple(check_shards(expand_shards(spec), name)), w) for name, spec, w in specs]


def _shard_sequence(src: Source, slot: int, slots: int, resampled: bool, rng: np.random.Generator) -> Iterator[str]:
    if resampled:
        while True:
            yield src.urls[int(rng.integers(len(src.urls)))]
    mine = src.urls[slot::slots]
    if not mine:
        raise NclipError(f"{src.name}: {len(src.urls)} shard(s) cannot be split over {slots} rank×worker "
                         "streams without resampling; set data.resampled=true or use fewer workers")
    while True:
        for i in rng.permutation(len(mine)):
            yield mine[int(i)]


def _source_records(src: Source, shards: Iterator[str], excluded: frozenset[str] = frozenset(),
                    reachable: frozenset[str] | None = None) -> Iterator[Record | Bad]:
    """The records of the shards in ``shards``, one after the other, without those whose key is in
    ``excluded`` (``data.exclude``: dropped as they stream by, before the mix and the shuffle
    buffer, so they never count as consumed). ``reachable``: the shards this stream can ever read
    (default: all of the source's); when every one of them has been read without a record left
    after the exclusion, it stops with an error instead of reading forever."""
    reachable = frozenset(src.urls) if reachable is None else reachable
    empty_in_a_row, limit = 0, 2 * len(src.urls) + 10
    exhausted: set[str] = set()  # shards read with nothing left after the exclusion
    for url in shards:
        n = kept = 0
        for rec in iter_records(url):
            n += 1
            if rec.key in excluded:
                continue
            kept += 1
            yield rec
        empty_in_a_row = 0 if n else empty_in_a_row + 1
        if empty_in_a_row >= limit:
            raise NclipError(f"{src.name}: no samples in {empty_in_a_row} shard reads in a row (e.g. {url}); "
                             "are the shards empty?")
        if excluded and exhausted is not None:
            if kept:
                exhausted = None  # a shard with kept samples: this stream always has data
            else:
                exhausted.add(url)
                if exhausted >= reachable:
                    raise NclipError(f"{src.name}: data.exclude leaves no sample in the {len(reachable)} shard(s) "
                                     f"this stream reads (e.g. {url})")


def raw_stream(sources: list[Source], seed: int, rank: int, stream: int, slot: int, slots: int,
               resampled: bool, shuffle_buffer: int, reseed: int = 0,
               excluded: frozenset[str] = frozenset()) -> Iterator[Record | Bad]:
    """Stages 1-3 of the module docstring: an endless, deterministic sequence of raw records,
    without the samples whose key is in ``excluded``."""
    base = [seed, _STREAM_TAG, reseed, rank, stream]
    iters = [
        _source_records(src, _shard_sequence(src, slot, slots, resampled, np.random.default_rng(base + [1, i])),
                        excluded, frozenset(src.urls if resampled else src.urls[slot::slots]))
        for i, src in enumerate(sources)
    ]
    if len(iters) == 1:
        mixed = iters[0]
    else:
        weights = np.array([s.weight for s in sources], dtype=np.float64)
        cdf = np.cumsum(weights / weights.sum())
        mix_rng = np.random.default_rng(base + [2])

        def _mix():
            while True:
                i = min(int(np.searchsorted(cdf, mix_rng.random(), side="right")), len(iters) - 1)
                yield next(iters[i])

        mixed = _mix()
    yield from _shuffled(mixed, shuffle_buffer, np.random.default_rng(base + [3]))


def source_streams(sources: list[Source], seed: int, rank: int, stream: int, slot: int, slots: int,
                   resampled: bool, shuffle_buffer: int, reseed: int = 0,
                   excluded: frozenset[str] = frozenset()) -> list[Iterator[Record | Bad]]:
    """``data.sampling: per_source``: stages 1 and 3 of the module docstring for every source apart,
    one endless, deterministic sequence of raw records per source, without the keys in ``excluded``."""
    base = [seed, _STREAM_TAG, reseed, rank, stream]
    return [_shuffled(_source_records(src, _shard_sequence(src, slot, slots, resampled,
                                                           np.random.default_rng(base + [4, i])),
                                      excluded, frozenset(src.urls if resampled else src.urls[slot::slots])),
                      shuffle_buffer, np.random.default_rng(base + [5, i]))
            for i, src in enumerate(sources)]


def batch_source(seed: int, step: int, weights: list[float]) -> int:
    """The source of the global batch of optimizer ``step`` under ``data.sampling: per_source``: drawn
    with probabilities ∝ ``weights`` by a generator seeded with (seed, step) alone, the same on every
    rank and worker and on resume."""
    cdf = np.cumsum(np.asarray(weights, dtype=np.float64) / sum(weights))
    u = np.random.default_rng([seed, _BATCH_SOURCE_TAG, step]).random()
    return min(int(np.searchsorted(cdf, u, side="right")), len(weights) - 1)


def _shuffled(records: Iterator[Record | Bad], size: int, rng: np.random.Generator) -> Iterator[Record | Bad]:
    """A shuffle buffer of ``size`` records (none for size <= 1)."""
    if size <= 1:
        yield from records
        return
    buf: list = []
    for rec in records:
        if len(buf) < size:
            buf.append(rec)
            continue
        j = int(rng.integers(size))
        buf[j], rec = rec, buf[j]
        yield rec


class ShardStreamDataset(IterableDataset):
    """This rank's endless sequence of local batches (see the module docstring).

    Yields (:class:`~nclip.batch.Batch` of pixels [b, 3, S, S], ids and mask [b, L], info) with info = {"stream": id,
    "consumed": raw records consumed by that stream, "skipped": bad records skipped by it, "bad": the
    (where, reason) of those skipped since the previous batch} and, under ``data.sampling:
    per_source``, "sources": the records consumed from each source.
    """

    def __init__(self, cfg: RunConfig, collate: Callable, local_batch: int, rank: int = 0, world_size: int = 1,
                 start_step: int = 0, resume: dict | None = None):
        self.cfg, self.collate, self.local_batch = cfg, collate, local_batch
        self.rank, self.world = rank, world_size
        self.start_step = start_step
        self.sources = sources_from_config(cfg)
        # {"streams": [[consumed, skipped, *per-source consumed], ...]} in stream order, or None
        self.resume = resume
        self.reseed = 0
        self.excluded: frozenset[str] = frozenset()
        if cfg.data.exclude is not None:  # sample keys, as `nclip data dedup` names shard samples
            from nclip.data.dedup import load_exclusions

            self.excluded = frozenset(load_exclusions(cfg.data.exclude))
        self.per_source = cfg.data.sampling == "per_source"
        self._bad: list[tuple[str, str]] = []  # this worker's skipped records since its last batch

    def _position_length(self) -> int:
        return 2 + (len(self.sources) if self.per_source else 0)

    def num_streams(self) -> int:
        return max(self.cfg.data.num_workers, 1)

    def plan_resume(self, saved: dict | None, exact: bool) -> None:
        """Continue from the checkpointed stream positions if they match this run's layout (world
        size, worker count) and ``exact``; otherwise re-seed every stream from the resume step,
        keeping only the count of bad samples."""
        n = self.num_streams()
        streams = saved.get("streams", []) if saved and saved.get("kind") == "stream" else []
        width = self._position_length()
        if (exact and len(streams) == n and saved.get("world_size") == self.world
                and all(len(s) == width for s in streams)):
            self.resume, self.reseed = {"streams": [[int(x) for x in s] for s in streams]}, 0
        elif self.start_step > 0:
            skipped = sum(int(s[1]) for s in streams)
            self.resume = {"streams": [[0, skipped if i == 0 else 0] + [0] * (width - 2) for i in range(n)]}
            self.reseed = self.start_step

    def initial_streams(self) -> list[list[int]]:
        """[records consumed, bad skipped, *per-source consumed] of every stream before its first batch."""
        if self.resume is None:
            return [[0] * self._position_length() for _ in range(self.num_streams())]
        return [list(s) for s in self.resume["streams"]]

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if workers != self.num_streams():
            raise NclipError(f"internal: {workers} loader workers for {self.num_streams()} streams")
        stream = (worker + self.start_step) % workers
        position = self.initial_streams()[stream]
        consumed, skipped = position[:2]
        d = self.cfg.data
        window = BadWindow(d.bad_window, d.max_bad_fraction)
        slot, slots = self.rank * workers + stream, self.world * workers
        if self.per_source:
            yield from self._per_source_batches(worker, workers, stream, slot, slots, position, window)
            return
        records = raw_stream(self.sources, self.cfg.seed, self.rank, stream, slot, slots, d.resampled,
                             d.shuffle_buffer, self.reseed, self.excluded)
        if consumed:
            next(itertools.islice(records, consumed - 1, None))  # fast-forward, nothing decoded
        items: list[tuple[torch.Tensor, str]] = []
        for rec in records:
            item = self._decode(rec, stream, consumed, window)
            consumed += 1
            if item is None:
                skipped += 1
                continue
            items.append(item)
            if len(items) == self.local_batch:
                batch, _ = self.collate(items)
                items = []
                yield batch, {"stream": stream, "consumed": consumed, "skipped": skipped,
                                          "bad": self._take_bad()}

    def _decode(self, rec: Record | Bad, stream: int, index: int, window: BadWindow):
        """(pixels, uint8 [3, S, S], caption, []) of the stream's ``index``-th raw record, augmented with
        randomness seeded by (seed, rank, stream, index), its caption chosen by ``data.caption_choice``
        from the same (:mod:`nclip.data.captions`: the record number stands in for the epoch and the
        index, which a stream has not); with hard negatives, the item's seventh element is the
        record's negatives (:mod:`nclip.data.hard_negatives`: its ``.json`` field, or the swap of its
        caption drawn by the same integers). None for a bad record (counted in ``window``)."""
        d = self.cfg.data
        out = decode_captions(rec, d.json_caption_key)
        if not isinstance(out, Bad) and d.hard_negative_key is not None:
            negatives = record_negatives(rec.parts, d.hard_negative_key)
            if isinstance(negatives, str):
                out = Bad(rec.key, rec.url, negatives)
        window.add(out if isinstance(out, Bad) else None, rec.url)
        if isinstance(out, Bad):
            self._bad.append((f"{out.url} {out.key}".rstrip(), out.reason))
            return None
        image, captions, _ = out
        draw = [self.reseed, self.rank, stream, index]
        rng = np.random.default_rng([self.cfg.seed, _AUG_TAG, *draw])
        caption = choose(captions, d.caption_choice, [self.cfg.seed, *draw])
        pixels = to_uint8_tensor(augment(image, d.image_size, d.augment, rng))
        if d.hard_negatives == "swap":
            swapped = swap_caption(caption if isinstance(caption, str) else caption[0], self.cfg.seed, draw)
            negatives = () if swapped is None else (swapped,)
        elif d.hard_negative_key is None:
            return pixels, caption, []
        return pixels, caption, [], None, None, None, negatives

    def _per_source_batches(self, worker: int, workers: int, stream: int, slot: int, slots: int,
                            position: list[int], window: BadWindow):
        """``data.sampling: per_source``: this stream's batches, each from the source of its step."""
        d = self.cfg.data
        consumed, skipped, per_source = position[0], position[1], list(position[2:])
        iters = source_streams(self.sources, self.cfg.seed, self.rank, stream, slot, slots, d.resampled,
                               d.shuffle_buffer, self.reseed, self.excluded)
        for records, n in zip(iters, per_source):
            if n:
                next(itertools.islice(records, n - 1, None))  # fast-forward, nothing decoded
        weights = [src.weight for src in self.sources]
        # batch b of the DataLoader is worker b mod W's; batch b serves optimizer step start + b
        for step in itertools.count(self.start_step + worker, workers):
            i = batch_source(self.cfg.seed, step, weights)
            items: list = []
            while len(items) < self.local_batch:
                item = self._decode(next(iters[i]), stream, consumed, window)
                consumed += 1
                per_source[i] += 1
                if item is None:
                    skipped += 1
                else:
                    items.append(item)
            batch, _ = self.collate(items)
            yield batch, {"stream": stream, "consumed": consumed, "skipped": skipped,
                                      "sources": list(per_source), "bad": self._take_bad()}

    def _take_bad(self) -> list[tuple[str, str]]:
        bad, self._bad = self._bad, []
        return bad
