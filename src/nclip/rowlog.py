"""Undo records for modules that restore their own buffers after a skipped step (nclip.train.snapshot).

A module whose big buffers a step writes only in part (CMSF's memory bank enqueues a few rows into
~1 GB at paper scale) puts back the rows it wrote instead of having the whole buffer copied before
every step. Here, below the objectives and the trainer, so that both may use it (docs/design.md,
layers).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class RestoresItself(Protocol):
    """A module that puts the buffers it names in ``self_restored_buffers`` back itself.

    ``begin_step()``: a step starts (forget the previous step's record); ``undo_step(skip)``: put
    the named buffers back as they were at ``begin_step`` -- unconditionally with ``skip`` None (a
    host-side caller), else where the 0-d device tensor ``skip`` is 1, without reading it on the
    host. Only one snapshot may reach such a module (the step's: the towers' snapshot of exact
    accumulation covers the towers, which hold none), or one's ``begin_step`` would drop the
    other's record."""

    self_restored_buffers: tuple[str, ...]

    def begin_step(self) -> None: ...

    def undo_step(self, skip: torch.Tensor | None = None) -> None: ...


class RowLog:
    """The undo record of in-place writes to a module's buffers: ``record(buffer, index)`` before
    writing rows ``index`` (a long tensor of distinct rows, on the buffer's device; None: the whole
    buffer, for small ones such as a pointer), ``undo(skip)`` writes the saved rows back, last
    write first, then forgets them; ``clear()`` forgets them. Costs a copy of the rows written, not
    of the buffer; reads nothing on the host."""

    def __init__(self):
        self.entries: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = []

    def clear(self) -> None:
        self.entries = []

    @torch.no_grad()
    def record(self, buffer: torch.Tensor, index: torch.Tensor | None = None) -> None:
        old = buffer.clone() if index is None else buffer.index_select(0, index)
        self.entries.append((buffer, index, old))

    @torch.no_grad()
    def undo(self, skip: torch.Tensor | None = None) -> None:
        keep = None if skip is None else skip.bool()
        for buffer, index, old in reversed(self.entries):
            current = buffer if index is None else buffer.index_select(0, index)
            back = old if keep is None else torch.where(keep, old, current)
            if index is None:
                buffer.copy_(back)
            else:
                buffer.index_copy_(0, index, back)
        self.entries = []
