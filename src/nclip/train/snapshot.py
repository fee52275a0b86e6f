"""The buffers of the training step's module before each step, put back when the step is skipped.

A step whose loss or gradient is not finite leaves weights, optimizer state *and* buffers as they
were (BatchNorm statistics, objective queues and centers, see :mod:`nclip.train.step`); buffers
change in the forward, before finiteness is known, so every step copies them first. The modules
that own buffers are found once; each step copies into the same storage (one multi-tensor copy)
rather than walking the module tree and allocating a clone per buffer, which was a visible share of
a CPU-sized step.

A module whose big buffers a step writes only in part (a memory bank that enqueues a few rows
into ~1 GB at paper scale, CMSF) may restore them itself, cheaper than a copy of the whole: it
names them in ``self_restored_buffers`` and implements :class:`nclip.rowlog.RestoresItself`. The snapshot then
copies the module's other buffers only, calls ``begin_step()`` at :meth:`BufferSnapshot.take` and
``undo_step(skip)`` where it would put the buffers back. :class:`nclip.rowlog.RowLog` is the undo record such a
module keeps: the rows it overwrites, saved before each write, written back in reverse order.
"""

from __future__ import annotations

import torch
from torch import nn

from nclip.rowlog import RestoresItself


def _self_restored(owner: nn.Module) -> tuple[str, ...]:
    return tuple(getattr(owner, "self_restored_buffers", ())) if isinstance(owner, RestoresItself) else ()


class BufferSnapshot:
    """``take()`` before a step, ``restore()`` after a skipped one (or ``restore_where(skip)``)."""

    def __init__(self, module: nn.Module):
        self.module = module
        # (prefix, owner) of every submodule; a buffer a step registers later in one of them is
        # picked up by the next take(), as a walk of named_buffers() would
        self.owners = [(name + "." if name else "", m) for name, m in module.named_modules()]
        self.own = {id(m): _self_restored(m) for _, m in self.owners}  # the buffers a module restores itself
        self.restoring = [m for _, m in self.owners if self.own[id(m)]]  # RestoresItself modules
        self.names: list[str] = []
        self.saved: list[torch.Tensor] = []

    def _current(self) -> tuple[list[str], list[torch.Tensor]]:
        names, tensors, seen = [], [], set()
        for prefix, owner in self.owners:
            own = self.own[id(owner)]
            for attr, b in owner._buffers.items():
                if b is not None and id(b) not in seen and attr not in own:  # a shared buffer once
                    seen.add(id(b))
                    names.append(prefix + attr)
                    tensors.append(b)
        return names, tensors

    def take(self) -> None:
        names, tensors = self._current()
        same = names == self.names and all(
            s.shape == b.shape and s.dtype == b.dtype and s.device == b.device for s, b in zip(self.saved, tensors))
        if same and tensors:
            with torch.no_grad():
                torch._foreach_copy_(self.saved, [b.detach() for b in tensors])
        elif not same:
            self.names, self.saved = names, [b.detach().clone() for b in tensors]
        for m in self.restoring:
            m.begin_step()

    @torch.no_grad()
    def restore_where(self, skip: torch.Tensor) -> None:
        """Put the buffers back as they were at :meth:`take` where ``skip`` (a 0-d device tensor,
        1: skip) says so, without reading it on the host (:mod:`nclip.train.gate`). A buffer that
        the step replaced by one of another shape needs the host's decision: :meth:`restore`."""
        current = dict(self.module.named_buffers())
        keep = skip.bool()
        if any(current.get(n) is None or current[n].shape != s.shape or current[n].dtype != s.dtype
               for n, s in zip(self.names, self.saved)):
            if bool(keep):
                self.restore()
            else:
                self._undo_self_restored(skip)
            return
        for name, saved in zip(self.names, self.saved):
            b = current[name]
            torch.where(keep, saved, b, out=b)  # in place: no temporary the size of the buffer
        self._undo_self_restored(skip)

    @torch.no_grad()
    def restore(self) -> None:
        """Put the buffers back as they were at :meth:`take` (re-registering any that the step
        replaced by a new tensor, e.g. a lazily sized one). The copies stay the snapshot's: a
        restored buffer never shares storage with them."""
        current = dict(self.module.named_buffers())
        for name, saved in zip(self.names, self.saved):
            b = current.get(name)
            if b is not None and b.shape == saved.shape and b.dtype == saved.dtype:
                b.copy_(saved)
            else:
                owner, _, attr = name.rpartition(".")
                self.module.get_submodule(owner).register_buffer(attr, saved.clone())
        self._undo_self_restored(None)

    def _undo_self_restored(self, skip: torch.Tensor | None) -> None:
        for m in self.restoring:
            m.undo_step(skip)
