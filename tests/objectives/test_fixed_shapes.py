"""The objectives' state at fixed shapes, without host reads (issue 32.1), equals what it replaced.

- A memory bank's :meth:`MemoryBank.rows` is its N rows with a ``valid`` mask; every loss given the
  mask (``bank_valid``, ``queue_valid``, ``candidate_valid``) equals the same loss on the filled rows
  alone, values and gradients in float64.
- :meth:`MemoryBank.enqueue` with a ``keep`` mask writes a fixed number of slots: the bank is the one
  that appending the kept rows one by one makes.
- ProtoCLIP's empty clusters are masked out of the prototype classifier, not dropped: the values
  and gradients of the classifier without them.
- The momentum update runs a few kernels per dtype and equals, bitwise, the parameter-by-parameter
  update; a skipped step leaves the target bitwise as it was.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from nclip.objectives import functional
from nclip.objectives.cmsf_bank import NO_LABEL, MemoryBank
from nclip.objectives.momentum import momentum_update

from references import leaves, ref_proto_loss

F64 = torch.float64
B, D, N, CLASSES = 6, 4, 12, 3


def _bank(filled: int, seed: int = 0) -> MemoryBank:
    """A bank of N rows with ``filled`` of them written (wrapped around when over N)."""
    g = torch.Generator().manual_seed(seed)
    bank = MemoryBank(D, N, aux_dim=2, dtype=F64)
    for start in range(0, filled, 5):
        n = min(5, filled - start)
        bank.enqueue(torch.randn(n, D, generator=g, dtype=F64), torch.randint(0, CLASSES, (n,), generator=g),
                     torch.randn(n, 2, generator=g, dtype=F64))
    return bank


# ---- the bank's fixed-shape rows ------------------------------------------------------------------


@pytest.mark.parametrize("filled", [0, 5, 12, 17])
def test_rows_are_the_view_then_unwritten_rows(filled):
    bank = _bank(filled)
    rows, view = bank.rows(), bank.view()
    f = min(filled, N)
    assert rows.embeddings.shape == (N, D) and rows.valid.tolist() == [True] * f + [False] * (N - f)
    for full, filled_only in zip(rows, view):
        assert torch.equal(full[:f], filled_only)
    assert torch.all(rows.embeddings[f:] == 0) and torch.all(rows.labels[f:] == NO_LABEL)


def _append_one_by_one(size: int, batches) -> list[int]:
    fifo: list[int] = []
    for ids, keep in batches:
        fifo += [i for i, k in zip(ids, keep) if k]
    return fifo[-size:]


@pytest.mark.parametrize("size,batches", [
    (5, [([0, 1, 2], [True, False, True]), ([3, 4, 5, 6], [False] * 4), ([7, 8, 9, 10], [True] * 4)]),
    (4, [(list(range(7)), [True, False, True, True, True, False, True]), ([7, 8], [True, True])]),  # g > N
    (3, [(list(range(8)), [False] * 7 + [True]), (list(range(8, 16)), [True] * 8)]),  # G > N, g < N, then g > N
    (6, [([0, 1], [False, False]), ([2, 3, 4, 5, 6, 7, 8], [True, True, False, True, True, True, True])]),
])
def test_keep_writes_what_appending_the_kept_rows_one_by_one_writes(size, batches):
    bank = MemoryBank(3, size, aux_dim=1, dtype=F64)
    for ids, keep in batches:
        x = torch.tensor([[1.0, float(i), 0.5] for i in ids], dtype=F64)
        bank.enqueue(x, torch.tensor(ids), torch.ones(len(ids), 1, dtype=F64), keep=torch.tensor(keep))
    want = _append_one_by_one(size, batches)
    view = bank.view()
    assert view.labels.tolist() == want
    torch.testing.assert_close(view.embeddings, torch.nn.functional.normalize(
        torch.tensor([[1.0, float(i), 0.5] for i in want], dtype=F64).reshape(-1, 3), dim=-1))
    written = sum(sum(k) for _, k in batches)
    assert int(bank.filled) == min(written, size) and int(bank.ptr) == written % size


# ---- every loss on the fixed-shape rows equals the loss on the filled rows ------------------------


def _padded(seed: int):
    """A bank of N rows of which a scattered subset is valid, and the same rows compacted."""
    g = torch.Generator().manual_seed(seed)
    valid = torch.rand(N, generator=g) < 0.6
    labels = torch.randint(0, CLASSES, (N,), generator=g)
    return valid, labels, labels[valid]


@pytest.mark.parametrize("k", [1, 3, None])
@pytest.mark.parametrize("labelled", [False, True])
def test_cmsf_with_bank_valid_is_cmsf_on_the_valid_rows(k, labelled):
    valid, bank_labels, kept_labels = _padded(k or 7)
    pred, target, bank = leaves((B, D), (B, D), (N, D), seed=3)
    q = torch.randint(0, CLASSES, (B,), generator=torch.Generator().manual_seed(4))
    true = torch.randint(0, CLASSES, (B,), generator=torch.Generator().manual_seed(5))
    lab = ({"query_labels": q, "bank_labels": bank_labels}, {"query_labels": q, "bank_labels": kept_labels})
    ours = functional.cmsf_terms(pred, target, bank, k=k, bank_valid=valid, true_query_labels=true,
                                 true_bank_labels=bank_labels, **(lab[0] if labelled else {}))
    ref = functional.cmsf_terms(pred, target, bank[valid], k=k, true_query_labels=true,
                                true_bank_labels=kept_labels, **(lab[1] if labelled else {}))
    for key in ref:
        torch.testing.assert_close(ours[key], ref[key], rtol=1e-12, atol=1e-14)
    for a, r in zip(torch.autograd.grad(ours["loss"], pred), torch.autograd.grad(ref["loss"], pred)):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-14)


def test_semi_and_cross_modal_constraints_with_bank_valid():
    valid, bank_labels, kept_labels = _padded(11)
    pred, target, bank, aux_q, aux_bank = leaves((B, D), (B, D), (N, D), (B, 3), (N, 3), seed=12)
    q = torch.tensor([0, -1, 2, 1, -1, 0])
    cols = torch.cat([torch.ones(B, dtype=torch.bool), valid])
    semi = functional.semi_supervised_constraint(q, bank_labels, N)  # labelled bank, then an unlabelled one
    semi_ref = functional.semi_supervised_constraint(q, kept_labels, int(valid.sum()))
    cross = functional.topk_constraint(aux_q, torch.cat([aux_q, aux_bank]), 4, candidate_valid=cols)
    cross_ref = functional.topk_constraint(aux_q, torch.cat([aux_q, aux_bank[valid]]), 4)
    assert torch.equal(cross[:, cols], cross_ref) and not cross[:, ~cols].any()
    for k in (2, None):
        ours = functional.cmsf_terms(pred, target, torch.cat([bank, bank]), k=k, constraint_mask=semi,
                                     bank_valid=torch.cat([valid, valid]))
        ref = functional.cmsf_terms(pred, target, torch.cat([bank[valid], bank[valid]]), k=k, constraint_mask=semi_ref)
        for key in ref:
            torch.testing.assert_close(ours[key], ref[key], rtol=1e-12, atol=1e-14)


def test_protonw_with_bank_valid_is_protonw_on_the_valid_rows():
    valid, bank_labels, kept_labels = _padded(21)
    pred, target, bank = leaves((B, D), (B, D), (N, D), seed=22)
    q = torch.randint(0, CLASSES, (B,), generator=torch.Generator().manual_seed(23))
    ours = functional.protonw_terms(pred, target, bank, q, bank_labels, num_classes=CLASSES, bank_valid=valid)
    ref = functional.protonw_terms(pred, target, bank[valid], q, kept_labels, num_classes=CLASSES)
    for key in ref:
        torch.testing.assert_close(ours[key], ref[key], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.autograd.grad(ours["loss"], pred)[0], torch.autograd.grad(ref["loss"], pred)[0],
                               rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("family", ["supcon", "paco"])
def test_supcon_family_with_queue_valid_is_the_loss_on_the_valid_rows(family):
    valid, queue_labels, kept_labels = _padded(31)
    z, queue, centers = leaves((B, 2, D), (N, D), (CLASSES, D), seed=32)
    labels = torch.randint(0, CLASSES, (B,), generator=torch.Generator().manual_seed(33))
    terms = functional.supcon_terms if family == "supcon" else (
        lambda *a, **kw: functional.paco_terms(*a[:2], centers, **kw))
    ours = terms(z, labels, queue=queue, queue_labels=queue_labels, queue_valid=valid)
    ref = terms(z, labels, queue=queue[valid], queue_labels=kept_labels)
    for key in ref:
        torch.testing.assert_close(ours[key], ref[key], rtol=1e-12, atol=1e-14)
    grads = [torch.autograd.grad(t["loss"], [z, centers], allow_unused=True) for t in (ours, ref)]
    for a, r in zip(*grads):
        assert (a is None) == (r is None)
        if a is not None:
            torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-14)


# ---- ProtoCLIP's empty clusters --------------------------------------------------------------------


def _unit(*shape, seed):
    return torch.nn.functional.normalize(torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64),
                                         dim=-1)


def test_proto_terms_mask_empty_clusters_as_if_dropped():
    h, c, c_t = _unit(6, 4, seed=5), _unit(5, 4, seed=6), _unit(5, 3, seed=7)
    valid = torch.tensor([True, False, True, True, False])
    labels = torch.tensor([0, 2, 3, 3, 0, 2])
    keep, remap = torch.tensor([0, 2, 3]), torch.tensor([0, -1, 1, 2, -1])
    for tt, teacher in ((0.01, None), (0.0, None), (0.05, c_t)):  # soft, hard, soft from the teacher's C (Eq. 5)
        a, b = ([x.clone().requires_grad_() for x in (h, c)] for _ in range(2))
        ours = functional.proto_terms(*a, labels, 0.1, tt, valid=valid, teacher_centroids=teacher)
        ref = ref_proto_loss(b[0], b[1][keep], remap[labels], 0.1, tt, None if teacher is None else teacher[keep])
        torch.testing.assert_close(ours["loss"], ref)
        for x, y in zip(torch.autograd.grad(ours["loss"], a), torch.autograd.grad(ref, b)):
            torch.testing.assert_close(x, y)
        ref_acc = functional.proto_terms(h, c[keep], remap[labels], 0.1, tt, teacher_centroids=None if teacher is None
                                         else teacher[keep])["acc"]
        assert ours["acc"] == ref_acc


# ---- the momentum update ---------------------------------------------------------------------------


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 5),
                              torch.nn.BatchNorm1d(5))
    net(torch.randn(6, 4))  # non-trivial running statistics
    with torch.no_grad():
        net[0].weight[0, :2] = torch.tensor([-0.0, 0.0])  # signed zeros stay as they are
    return net


def _per_tensor(target: torch.nn.Module, online: torch.nn.Module, m: float) -> None:
    """The update as it was, one parameter at a time."""
    online_params, online_buffers = dict(online.named_parameters()), dict(online.named_buffers())
    with torch.no_grad():
        for name, t in target.named_parameters():
            t.copy_((t * m).add_(online_params[name].to(t.dtype), alpha=1.0 - m))
        for name, t in target.named_buffers():
            t.copy_(online_buffers[name])


def _bits(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor's bytes (signed zeros and NaN payloads included)."""
    return {k: v.detach().clone().reshape(-1).view(torch.uint8) for k, v in module.state_dict().items()}


@pytest.mark.parametrize("m", [0.0, 0.99, 0.7, 1.0])
def test_momentum_update_is_bitwise_the_per_tensor_update_and_gated(m):
    online = _net(1)
    ref, gated, skipped = _net(0), _net(0), _net(0)
    before = _bits(skipped)
    _per_tensor(ref, online, m)
    momentum_update(gated, online, m, taken=torch.ones(()))
    momentum_update(skipped, online, m, taken=torch.zeros(()))
    ungated = _net(0)
    momentum_update(ungated, online, m)
    want = _bits(ref)
    for got in (_bits(gated), _bits(ungated)):
        assert all(torch.equal(got[k], want[k]) for k in want)
    after = _bits(skipped)
    assert all(torch.equal(after[k], before[k]) for k in before)  # a skipped step moves nothing, bitwise


def test_momentum_update_runs_a_few_kernels_per_dtype_not_per_tensor():
    target, online = _net(0), _net(1)
    tensors = len(list(target.parameters())) + len(list(target.buffers()))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        momentum_update(target, online, 0.9, taken=torch.ones(()))
    wheres = sum(1 for e in prof.events() if e.name == "aten::where")
    # parameters, float buffers (running statistics), long buffers (num_batches_tracked)
    assert wheres == 3 < tensors
