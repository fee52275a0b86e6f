"""BufferSnapshot: a skipped step puts every buffer back bitwise, a taken one keeps the step's; a
module that restores its own buffers (a memory bank written a few rows at a time) is left to do
so, with only the rows it overwrote saved, and nothing is read on the host."""

from __future__ import annotations

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from nclip.rowlog import RestoresItself, RowLog
from nclip.train.snapshot import BufferSnapshot

from host_syncs import SYNC_OPS

N, D = 5, 3


class Ring(nn.Module):
    """A FIFO of N rows written a few at a time (as a memory bank), restoring them itself."""

    self_restored_buffers = ("rows", "ptr")

    def __init__(self):
        super().__init__()
        self.register_buffer("rows", torch.arange(N * D, dtype=torch.float32).view(N, D))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))
        self.register_buffer("writes", torch.zeros((), dtype=torch.long))  # left to the snapshot
        self.log = RowLog()

    def begin_step(self) -> None:
        self.log.clear()

    def undo_step(self, skip: torch.Tensor | None = None) -> None:
        self.log.undo(skip)

    def write(self, x: torch.Tensor) -> None:
        pos = (self.ptr + torch.arange(x.shape[0])) % N
        self.log.record(self.rows, pos)
        self.log.record(self.ptr)
        self.rows.index_copy_(0, pos, x)
        self.ptr.copy_((self.ptr + x.shape[0]) % N)
        self.writes.add_(1)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict({"ring": Ring(), "bn": nn.BatchNorm1d(D)})


def _step(model: nn.Module) -> None:
    """Two writes of 3 rows: rows 0-2, then 3, 4 and 0 again (row 0 written twice)."""
    for _ in range(2):
        model["ring"].write(torch.randn(3, D))
    model["bn"](torch.randn(4, D))  # running statistics move


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_skipped_step_puts_back_every_buffer_and_a_taken_one_keeps_the_step():
    model = _model()
    assert isinstance(model["ring"], RestoresItself) and not isinstance(model["bn"], RestoresItself)
    snap = BufferSnapshot(model)
    for skip in (1, 0, 1):
        before = _state(model)
        snap.take()
        assert "ring.rows" not in snap.names and "ring.ptr" not in snap.names and "ring.writes" in snap.names
        _step(model)
        after = _state(model)
        assert not _equal(before, after)
        # only the rows written (3 + 3) and the pointer are saved, not the ring
        assert sum(old.numel() for *_, old in model["ring"].log.entries) == 6 * D + 2
        flag = torch.tensor(skip)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            snap.restore_where(flag)
        assert not {e.name for e in prof.events() if e.name in SYNC_OPS}
        assert _equal(_state(model), before if skip else after), skip
        assert not model["ring"].log.entries  # the record is forgotten either way


def test_restore_on_the_host_puts_back_the_self_restored_buffers_too():
    model = _model()
    snap = BufferSnapshot(model)
    before = _state(model)
    snap.take()
    _step(model)
    _step(model)  # several steps' writes (a memory check's probe batches): undone last first
    snap.restore()
    assert _equal(_state(model), before)


def test_a_module_without_the_attribute_is_copied_whole():
    class Plain(Ring):
        self_restored_buffers = ()

    model = nn.ModuleDict({"ring": Plain()})
    snap = BufferSnapshot(model)
    before = _state(model)
    snap.take()
    assert {"ring.rows", "ring.ptr", "ring.writes"} <= set(snap.names)
    model["ring"].write(torch.randn(2, D))
    snap.restore_where(torch.tensor(1))
    assert _equal(_state(model), before)


def test_cmsf_bank_restores_its_own_rows():
    """CMSF's memory bank restores itself: the snapshot copies none of its buffers, and a skipped
    step (two enqueues, wrapping around) leaves bank, labels, pointer and fill bitwise as they were;
    a taken step keeps what it wrote."""
    from nclip.objectives.cmsf_bank import MemoryBank

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"bank": MemoryBank(4, size=10)})
    bank = model["bank"]
    bank.enqueue(torch.randn(7, 4), torch.arange(7), global_batch=False)
    snap = BufferSnapshot(model)
    for skip, kept in ((1.0, False), (0.0, True)):
        before = {k: v.clone() for k, v in bank.state_dict().items()}
        snap.take()
        assert not any(name.startswith("bank.") for name in snap.names)  # nothing of the bank copied
        bank.enqueue(torch.randn(3, 4), torch.arange(3), global_batch=False)
        bank.enqueue(torch.randn(4, 4), torch.arange(4), keep=torch.tensor([True, False, True, True]),
                     global_batch=False)
        snap.restore_where(torch.tensor(skip))
        same = all(torch.equal(v, before[k]) for k, v in bank.state_dict().items())
        assert same != kept, (skip, bank.ptr, bank.filled)
