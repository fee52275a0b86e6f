"""One training batch by name: what flows from collation through the device feed and accumulation to
the objectives.

A batch is this rank's rows of one optimizer step: ``pixels``, ``ids`` and ``mask`` always, and the
per-row tensors an objective asked for (``Objective.label_request``, ``Objective.episodic``):

- pixels: the images, float32 [B, 3, S, S] on the device (uint8 before the device feed normalises
  them); with two views per image [B, 2, 3, S, S], the online (strong) view first, the target
  (weak) view second (:mod:`nclip.data.views`; before the feed finishes them, the workers' crops).
  The views need no field of their own: the image tower reads them where it reads one view;
- ids, mask: the captions' token ids and attention mask [B, L]; with several captions per image
  (``data.caption_choice: all``) [B, C, L], C caption slots per image;
- caption_valid: [B, C] which of the C slots hold a caption (the others are padding), with
  several captions per image only;
- negative_valid: [B, N] which of an image's N hard negative slots hold a negative, with hard
  negatives only (``data.hard_negative_key``, ``data.hard_negatives``); ids and mask are then
  [B, C + N, L], the negatives in the last N slots (:mod:`nclip.objectives.hard_negatives`);
- labels, true_labels: [B] the training label (corrupted or -1 = unlabelled, per the request) and the
  clean one (diagnostics);
- index: [B] the rows' dataset indices (a frozen embedding of every training sample is looked up by it);
- episode: [B] the rows' positions in their episode (ProtoCLIP's episodic driver: the objective reads
  the rows' cluster assignments by them).

Every field is split and joined the same way, row by row: the micro-batches of accumulation are
:meth:`Batch.chunk` (``torch.chunk`` of every field). Layer 0: imports torch only.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Callable

import torch


@dataclass
class Batch:
    """A batch of B rows (module docstring). ``pixels`` may also be a NamedTuple holding tensors (the
    two views' crops as the loader's workers make them, :class:`nclip.data.views.ViewCrops`):
    :meth:`map` reaches the tensors inside it."""

    pixels: Any
    ids: torch.Tensor
    mask: torch.Tensor
    labels: torch.Tensor | None = None
    true_labels: torch.Tensor | None = None
    index: torch.Tensor | None = None
    episode: torch.Tensor | None = None
    caption_valid: torch.Tensor | None = None
    negative_valid: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.ids.shape[0]

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        """A batch of ``fn`` applied to every tensor (absent fields stay None)."""
        return Batch(**{f.name: _apply(fn, getattr(self, f.name)) for f in fields(self)})

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the batch (for ``record_stream`` and the like)."""
        out: list[torch.Tensor] = []

        def keep(t: torch.Tensor) -> torch.Tensor:
            out.append(t)
            return t

        self.map(keep)
        return out

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """Every tensor on ``device`` (``non_blocking``: from pinned memory, asynchronously)."""
        return self.map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        """Called by the DataLoader's ``pin_memory`` for a batch it hands to a CUDA device."""
        return self.map(lambda t: t.pin_memory())

    def rows(self, start: int, stop: int) -> Batch:
        """Rows ``start`` to ``stop`` (a view of every field)."""
        return self.map(lambda t: t[start:stop])

    def chunk(self, k: int) -> list[Batch]:
        """``k`` micro-batches as ``torch.chunk`` splits every field (the last may be smaller)."""
        sizes = [len(c) for c in self.ids.chunk(k)]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [self.rows(s, s + n) for s, n in zip(starts, sizes)]

    def with_pixels(self, pixels) -> Batch:
        """The same rows with other pixels (normalised, two views finished)."""
        return replace(self, pixels=pixels)


def _apply(fn, x):
    if x is None:
        return None
    if torch.is_tensor(x):
        return fn(x)
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a NamedTuple of tensors and plain values
        return type(x)(*(_apply(fn, v) for v in x))
    return x
