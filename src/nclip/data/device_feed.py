"""This rank's batches already on the device: the last hop of the input pipeline.

:class:`DeviceFeed` wraps the trainer's batch iterable (:class:`nclip.data.loader.TrainData`, or a
data source such as :class:`nclip.train.episodic.EpisodicData`) and yields its
:class:`~nclip.batch.Batch` es on the device, with uint8 pixels normalised there into float32 (CLIP's mean and std, as
:func:`nclip.data.transforms.normalize_pixels`) and two views' uint8 crops finished there (the
strong view's colour steps, then the normalisation: :func:`nclip.data.views.finish_views`, from
the parameters the workers drew); float pixels (episodic batches) pass as they are.

On CUDA the batches come from pinned host memory (the loader's ``pin_memory``) and every tensor is
copied with ``non_blocking=True`` on a side stream. With a source that allows it (``lookahead``,
:class:`TrainData`'s batches depend on their step alone) the *next* batch is read and its copy
enqueued before the current one is handed out, so the copy of batch t + 1 overlaps step t even
when step t ends with a host read (a log step; the other steps read nothing, nclip.train.gate).
The consumer's stream waits on an event recorded after each batch's copy (not on the whole side
stream, which by then holds the next batch's copy too),
and ``record_stream`` keeps the caching allocator from reusing a batch's memory until the steps that
read it are done. EpisodicData reads ahead of nothing: a batch at an episode boundary runs the
model, which must have taken the step before.

Reading ahead must not move what the trainer checkpoints: ``state()`` and ``skipped`` are those of
the source right after the batch last handed out (a snapshot), and an error raised while reading
ahead is raised when that batch is asked for, so a run stops at the step it stopped at before.

On CUDA the views are finished on the side stream with the copy, so that for a source read ahead
they are made while the previous step runs. On the CPU the feed is a pass-through plus the
normalisation, bitwise the float pixels the loader made before pixels travelled as uint8, and plus
the views' finishing, bitwise what :func:`nclip.data.loader.train_loader` without a device hands out.

Data wait: the host time spent in ``__next__`` (the loader's wait; on CUDA no device sync is
taken to measure it), summed until :meth:`DeviceFeed.pop_wait` reads and resets it.
"""

from __future__ import annotations

import time
from typing import Iterator

import torch

from nclip.batch import Batch
from nclip.data.transforms import clip_stats, normalize_pixels
from nclip.data.views import ViewCrops, finish_views


class _Ahead:
    """A batch read from the source, its copy in flight, and the source's position after it."""

    def __init__(self, batch=None, event=None, state=None, skipped=0, error: BaseException | None = None):
        self.batch, self.event, self.state, self.skipped, self.error = batch, event, state, skipped, error


class DeviceFeed:
    """``source``'s batches on ``device`` (module docstring). ``lookahead``: read the next batch
    before handing out the current one (default: the source's ``lookahead`` attribute, else off)."""

    def __init__(self, source, device: torch.device | str, lookahead: bool | None = None):
        self.source, self.device = source, torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.lookahead = bool(getattr(source, "lookahead", False) if lookahead is None else lookahead)
        self.stats = clip_stats(self.device)  # made once: on a GPU a blocking copy
        self._seen: tuple[dict, int] | None = None  # (state, skipped) after the batch last handed out
        self._wait_s, self._waits = 0.0, 0

    # ---- what the trainer reads besides the batches --------------------------------------------

    @property
    def size(self) -> int | None:
        return getattr(self.source, "size", None)

    @property
    def text_counts(self) -> dict:
        return getattr(self.source, "text_counts", {})

    @property
    def skipped(self) -> int:
        return self._seen[1] if self._seen is not None else self.source.skipped

    def state(self) -> dict:
        return self._seen[0] if self._seen is not None else self.source.state()

    def __len__(self) -> int:
        return len(self.source)

    def pop_wait(self) -> tuple[float, int]:
        """(seconds waited, batches handed out) since the last call."""
        out = (self._wait_s, self._waits)
        self._wait_s, self._waits = 0.0, 0
        return out

    # ---- iteration -------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        batches = iter(self.source)
        stream = None
        if self.cuda:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))  # self.stats' copy, made on that stream
        t0 = time.perf_counter()
        ahead = self._read(batches, stream)
        while ahead is not None:
            current = ahead
            ahead = self._read(batches, stream) if self.lookahead else None
            if current.error is not None:
                raise current.error
            if self.lookahead:
                self._seen = current.state, current.skipped
            batch = self._hand_out(current)
            self._wait_s += time.perf_counter() - t0
            self._waits += 1
            yield batch
            t0 = time.perf_counter()
            if not self.lookahead:
                ahead = self._read(batches, stream)

    def _read(self, batches: Iterator, stream) -> _Ahead | None:
        """The source's next batch with its copy enqueued; None at the end. While reading ahead an
        error is kept for the step that asks for this batch."""
        try:
            batch = next(batches)
        except StopIteration:
            return None
        except Exception as e:
            if not self.lookahead:
                raise
            return _Ahead(error=e)
        state = self.source.state() if self.lookahead else None
        skipped = self.source.skipped if self.lookahead else 0
        if stream is None:
            return _Ahead(self._moved(batch), None, state, skipped)
        with torch.cuda.stream(stream):
            moved = self._moved(batch)
            event = torch.cuda.Event()
            event.record(stream)
        return _Ahead(moved, event, state, skipped)

    def _moved(self, batch: Batch) -> Batch:
        """Every tensor on the device (asynchronously from pinned memory), uint8 pixels normalised,
        two views finished."""
        out = batch.to(self.device, non_blocking=True)
        if isinstance(out.pixels, ViewCrops):
            return out.with_pixels(finish_views(out.pixels, self.stats))
        if out.pixels.dtype == torch.uint8:
            return out.with_pixels(normalize_pixels(out.pixels, self.stats))
        return out

    def _hand_out(self, ahead: _Ahead) -> Batch:
        if ahead.event is None:
            return ahead.batch
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(ahead.event)
        for x in ahead.batch.tensors():
            x.record_stream(consumer)  # freed after the consumer's work on it, not the copy's
        return ahead.batch
