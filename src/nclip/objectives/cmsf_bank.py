"""CMSF's memory bank M (Sec. 2): a FIFO queue of the momentum encoder's targets u, with their labels
and, for the cross-modal constraint (Sec. 2.3), the frozen second embedding u_c "in which the data
points follow the same ordering as in M".

The bank is state, so it lives in registered buffers (``bank``, ``labels``, ``ptr``, ``filled``, and
``aux`` when enabled) and checkpoints hold it. :meth:`MemoryBank.enqueue` gathers the batch of every
rank through :mod:`nclip.distributed` (no gradient) before writing, so every rank holds the same bank
after every step: the same candidates as one process with the whole batch.

Order of a training step, as the loss expects it: compute the loss against ``bank.rows()`` (M before
this batch; :func:`nclip.objectives.functional.cmsf_terms` adds the batch's own targets to the
candidates, as the paper enqueues before searching), then ``bank.enqueue(u, labels)``.

No host sync on a training step: :meth:`MemoryBank.rows` has the bank's fixed shape [N, ...] with a
``valid`` mask of the rows written so far (the losses take it as ``bank_valid`` and leave the other
rows out, so they compute over the filled rows alone), and :meth:`MemoryBank.enqueue` writes a fixed
number of slots, whatever the ``keep`` mask holds. :meth:`MemoryBank.view` (the filled rows alone)
reads the fill count on the host: for inspection and tests.

Semi-supervised setting (Sec. 2.1.5, App. A.2: "two equal-size, separate memory banks for labeled
and unlabeled data so that one cannot dominate the whole memory bank"): two instances of the same
size. Every sample goes to the unlabelled one, only labelled samples (label ≠ ``UNLABELLED``) to the
labelled one; the loss searches ``cat([labelled.rows().embeddings, unlabelled.rows().embeddings])``
under :func:`~nclip.objectives.functional.semi_supervised_constraint`::

    lab, unl = labelled.rows(), unlabelled.rows()
    mask = functional.semi_supervised_constraint(labels, lab.labels, unl.embeddings.shape[0])
    loss = functional.cmsf_terms(v, u, torch.cat([lab.embeddings, unl.embeddings]), constraint_mask=mask,
                                 bank_valid=torch.cat([lab.valid, unl.valid]))["loss"]
    unlabelled.enqueue(u, labels)
    labelled.enqueue(u, labels, keep=labels != functional.UNLABELLED)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from nclip import distributed as collectives
from nclip.rowlog import RowLog

NO_LABEL = -1  # label stored for rows enqueued without one (= functional.UNLABELLED)


class BankView(NamedTuple):
    """The rows of a :class:`MemoryBank`, oldest first: its N rows (:meth:`MemoryBank.rows`; rows not
    written yet come last, zero, labelled ``NO_LABEL`` and not ``valid``) or its F filled rows
    (:meth:`MemoryBank.view`)."""

    embeddings: torch.Tensor  # [N or F, D]
    labels: torch.Tensor  # [N or F]
    aux: torch.Tensor | None  # [N or F, Da], or None without an aux embedding
    valid: torch.Tensor  # [N or F] bool: the row holds an enqueued sample


class MemoryBank(nn.Module):
    """FIFO of ℓ2-normalised target embeddings u (with labels, optionally aux embeddings) of size N.

    Args:
        dim: D, the width of the targets.
        size: N, the number of rows kept (default 128k: the paper's "default memory bank size is
            128k", the authors' ``--mem_bank_size 128000``; 64k for IN-100 in Sec. 2.2, 8192 in Sec. 2.3).
        aux_dim: Da, the width of a frozen second embedding stored row by row with the targets
            (cross-modal constraint, Sec. 2.3); None stores none.
        dtype: of the stored embeddings.

    Buffers: ``bank`` [N, D], ``labels`` [N] (``NO_LABEL`` where none was given), ``ptr`` (the next row
    to write, which is also the oldest row once the bank is full), ``filled`` (rows written so far,
    at most N), and ``aux`` [N, Da] when ``aux_dim`` is set.

    A skipped training step puts back only the rows it wrote (:class:`nclip.rowlog.RestoresItself`):
    the trainer need not copy the whole bank (~131 MB at 128k × 256 float32) before every step.
    """

    self_restored_buffers = ("bank", "labels", "aux", "ptr", "filled")

    def __init__(self, dim: int, size: int = 128_000, *, aux_dim: int | None = None,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        if dim <= 0:
            raise ValueError(f"dim must be positive, got {dim}")
        if size <= 0:
            raise ValueError(f"size must be positive, got {size}")
        if aux_dim is not None and aux_dim <= 0:
            raise ValueError(f"aux_dim must be positive or None, got {aux_dim}")
        self.size, self.dim, self.aux_dim = size, dim, aux_dim
        self.register_buffer("bank", torch.zeros(size, dim, dtype=dtype))
        self.register_buffer("labels", torch.full((size,), NO_LABEL, dtype=torch.long))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))
        self.register_buffer("filled", torch.zeros((), dtype=torch.long))
        self.register_buffer("aux", torch.zeros(size, aux_dim, dtype=dtype) if aux_dim is not None else None)
        self._undo = RowLog()  # what this step wrote, to put back if it is skipped

    def begin_step(self) -> None:
        self._undo.clear()

    def undo_step(self, skip: torch.Tensor | None = None) -> None:
        self._undo.undo(skip)

    def extra_repr(self) -> str:
        return f"size={self.size}, dim={self.dim}, aux_dim={self.aux_dim}"

    @torch.no_grad()
    def enqueue(
        self,
        targets: torch.Tensor,
        labels: torch.Tensor | None = None,
        aux: torch.Tensor | None = None,
        *,
        keep: torch.Tensor | None = None,
        global_batch: bool = True,
    ) -> None:
        """Append the batch of every rank (rank order) and evict the oldest rows beyond N.

        targets: [B, D] (normalised here); labels: [B] or None (stored as ``NO_LABEL``); aux: [B, Da],
        required iff the bank has an aux embedding (normalised here); keep: [B] bool, only these rows
        are enqueued (the labelled bank of the semi-supervised setting). Every rank must pass the same
        B. A global batch larger than N keeps its last N rows.
        """
        b = targets.shape[0]
        if targets.ndim != 2 or targets.shape[1] != self.dim:
            raise ValueError(f"targets must be [B, D={self.dim}], got {tuple(targets.shape)}")
        if labels is not None and tuple(labels.shape) != (b,):
            raise ValueError(f"labels must be [B={b}], got {tuple(labels.shape)}")
        if (aux is None) != (self.aux_dim is None):
            raise ValueError("aux must be given exactly when the bank was built with aux_dim")
        if aux is not None and tuple(aux.shape) != (b, self.aux_dim):
            raise ValueError(f"aux must be [B={b}, Da={self.aux_dim}], got {tuple(aux.shape)}")
        if keep is not None and (tuple(keep.shape) != (b,) or keep.dtype != torch.bool):
            raise ValueError(f"keep must be bool [B={b}], got {keep.dtype} {tuple(keep.shape)}")

        def gather(x: torch.Tensor) -> torch.Tensor:  # the same global batch on every rank
            x = x.detach().to(self.bank.device)
            return collectives.all_gather_no_grad(x) if global_batch else x

        rows = gather(F.normalize(targets.detach().to(self.bank.dtype), dim=-1))  # [G, D], G = W·B
        lab = gather(labels.long() if labels is not None
                     else torch.full((b,), NO_LABEL, dtype=torch.long, device=targets.device))  # [G]
        extra = gather(F.normalize(aux.detach().to(self.bank.dtype), dim=-1)) if aux is not None else None
        kept = None if keep is None else gather(keep.to(torch.uint8)).bool()  # bytes: every backend gathers them
        self._write(rows, lab, extra, kept)

    def _write(self, rows: torch.Tensor, lab: torch.Tensor, extra: torch.Tensor | None,
               kept: torch.Tensor | None) -> None:
        """FIFO-write the g kept rows of [G, ...] (all G without ``kept``), the last N of them when g > N.

        Fixed shapes whatever ``kept`` holds (g stays on the device): the w = min(G, N) slots before the
        new write pointer ptr + g are written, slot t with the kept row of rank g − w + t, or with its
        own content when that rank is negative (fewer than w rows kept). The slots are distinct (w ≤ N),
        and the bank ends as if the g kept rows had been appended one by one."""
        device, size, total = self.bank.device, self.size, rows.shape[0]
        w = min(total, size)
        if kept is None:
            g, rank = total, torch.arange(total - w, total, device=device)  # [w]
            source, write = rank, None
        else:
            g = kept.sum()
            rank = g - w + torch.arange(w, device=device)  # [w], may be < 0
            first = torch.argsort((~kept).to(torch.uint8), stable=True)  # the kept rows first, in their order
            source, write = first[rank.clamp(min=0)], rank >= 0
        slots = (self.ptr + rank) % size  # [w]: rank r goes to ptr + r (wraps around)
        for buf, new in ((self.bank, rows), (self.labels, lab), (self.aux, extra)):
            if new is not None:
                values = new[source]
                if write is not None:
                    values = torch.where(write.view(-1, *[1] * (values.ndim - 1)), values, buf[slots])
                self._undo.record(buf, slots)
                buf.index_copy_(0, slots, values)
        self._undo.record(self.ptr)
        self._undo.record(self.filled)
        self.ptr.copy_((self.ptr + g) % size)
        self.filled.copy_(torch.clamp(self.filled + g, max=size))

    def rows(self) -> BankView:
        """All N rows, oldest first, with ``valid`` True for the filled ones (the first F): fixed shapes,
        nothing read on the host, the same on every rank. Rows not written yet are zero, ``NO_LABEL``."""
        arange = torch.arange(self.size, device=self.bank.device)
        order = (self.ptr - self.filled + arange) % self.size  # [N]: before the bank is full, ptr = filled
        return BankView(self.bank[order], self.labels[order], self.aux[order] if self.aux is not None else None,
                        arange < self.filled)

    def view(self) -> BankView:
        """The F filled rows alone, oldest first: reads F on the host (a device sync), so for inspection
        and tests; a training step uses :meth:`rows`."""
        f = int(self.filled)
        full = self.rows()
        return BankView(full.embeddings[:f], full.labels[:f], full.aux[:f] if full.aux is not None else None,
                        full.valid[:f])
