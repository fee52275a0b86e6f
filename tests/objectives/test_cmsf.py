"""CMSF (Constrained Mean Shift): Eq. 1 against a float64 transcription (values, gradients), its special
cases (BYOL, MSF, top-all, Tab. 2e), the constraints (labels, cross-modal, semi-supervised), the NN
purity diagnostic, the memory bank, the momentum encoder, and 2 gloo ranks against 1 process."""

import math

import pytest
import torch

from nclip.objectives import functional
from nclip.objectives.cmsf_bank import NO_LABEL, MemoryBank
from nclip.objectives.momentum import momentum_at, momentum_update

from distributed_utils import run_ranks
from references import assert_value_and_grads, leaves, ref_cmsf

F64 = torch.float64


def _labels(n, classes, seed):
    return torch.randint(0, classes, (n,), generator=torch.Generator().manual_seed(seed))


def _unit(x):
    return x / x.norm(dim=-1, keepdim=True)


# ---- Eq. 1 against the transcription -----------------------------------------------------------


@pytest.mark.parametrize("seed,b,n,d,k,classes,include_target", [
    (0, 1, 0, 3, 10, None, True),  # batch of one, empty bank: S = {u}
    (1, 6, 20, 5, 3, None, True),  # MSF
    (2, 8, 30, 4, 10, 3, True),  # supervised, the paper's k
    (3, 5, 12, 6, 4, 4, False),  # Tab. 2e
    (4, 7, 25, 3, None, 2, True),  # top-all
    (5, 4, 9, 5, None, None, False),
    (6, 9, 40, 8, 50, 5, True),  # k above every constrained set
    (7, 6, 3, 4, 2, 6, False),  # rows whose constrained set is empty
])
def test_cmsf_matches_eq1_values_and_grads(seed, b, n, d, k, classes, include_target):
    pred, target, bank = leaves((b, d), (b, d), (n, d), seed=seed)
    lab = {} if classes is None else {"query_labels": _labels(b, classes, seed),
                                      "bank_labels": _labels(n, classes, seed + 1)}
    ours = functional.cmsf_terms(pred, target, bank, k=k, include_target=include_target, **lab)["loss"]
    ref = ref_cmsf(pred, target, bank, k, lab.get("query_labels"), lab.get("bank_labels"), include_target)
    # gradient to pred only: target and bank are constants of the loss
    assert torch.autograd.grad(ours, [target, bank], retain_graph=True, allow_unused=True) == (None, None)
    assert_value_and_grads(ours, ref, [pred])


@pytest.mark.parametrize("k", [1, 3, None])
def test_constraint_mask_matches_transcription(k):
    b, n, d = 6, 14, 4
    pred, target, bank = leaves((b, d), (b, d), (n, d), seed=11)
    mask = torch.rand(b, b + n, generator=torch.Generator().manual_seed(3)) < 0.4
    ql, bl = _labels(b, 2, 4), _labels(n, 2, 5)
    ours = functional.cmsf_terms(pred, target, bank, k=k, constraint_mask=mask, query_labels=ql, bank_labels=bl)["loss"]
    assert_value_and_grads(ours, ref_cmsf(pred, target, bank, k, ql, bl, True, mask), [pred])


def test_k1_is_byol():
    pred, target, bank = leaves((7, 5), (7, 5), (30, 5), seed=2)
    for lab in ({}, {"query_labels": _labels(7, 3, 0), "bank_labels": _labels(30, 3, 1)}):
        byol = (2 - 2 * torch.cosine_similarity(pred, target.detach(), dim=1)).mean()
        assert_value_and_grads(functional.cmsf_terms(pred, target, bank, k=1, **lab)["loss"], byol, [pred])


@pytest.mark.parametrize("k", [1, 5, 36])
def test_no_labels_is_msf(k):
    """MSF's loss as its code writes it: enqueue, top-k by 2 − 2 u·M, mean of 2 − 2 v·M over them."""
    pred, target, bank = leaves((6, 8), (6, 8), (30, 8), seed=5)
    q, t = _unit(pred), _unit(target.detach())
    mem = torch.cat([t, _unit(bank.detach())])  # [B + N, D]: the batch is enqueued before the search
    idx = (2 - 2 * t @ mem.T).topk(k, dim=1, largest=False).indices
    msf = torch.gather(2 - 2 * q @ mem.T, 1, idx).mean(1).mean()
    ours = functional.cmsf_terms(pred, target, bank, k=k)["loss"]
    assert_value_and_grads(ours, msf, [pred])
    one_class = functional.cmsf_terms(pred, target, bank, k=k, query_labels=torch.zeros(6, dtype=torch.long),
                                     bank_labels=torch.zeros(30, dtype=torch.long))["loss"]
    torch.testing.assert_close(one_class, ours.detach())


def test_top_all_is_the_mean_of_the_constrained_set():
    pred, target, bank = leaves((5, 4), (5, 4), (11, 4), seed=8)
    ql, bl = _labels(5, 3, 1), _labels(11, 3, 2)
    top_all = functional.cmsf_terms(pred, target, bank, k=None, query_labels=ql, bank_labels=bl)
    large_k = functional.cmsf_terms(pred, target, bank, k=1000, query_labels=ql, bank_labels=bl)["loss"]
    torch.testing.assert_close(top_all["loss"], large_k)
    cand, cand_lab = _unit(torch.cat([target, bank]).detach()), torch.cat([ql, bl])
    rows = [2 - 2 * _unit(pred[i]) @ cand[cand_lab == ql[i]].mean(0) for i in range(5)]
    torch.testing.assert_close(top_all["loss"], torch.stack(rows).mean())
    torch.testing.assert_close(top_all["neighbours"], top_all["constrained_size"])
    # MSF top-all: every candidate
    all_rows = 2 - 2 * (_unit(pred) @ cand.mean(0))
    torch.testing.assert_close(functional.cmsf_terms(pred, target, bank, k=None)["loss"], all_rows.mean())


# ---- the constraint: a candidate outside M̂ is never selected -----------------------------------


def test_label_constraint_never_selects_another_label():
    """Rows of other labels are planted at the queries themselves (the nearest possible); with the
    constraint labels as 'true' labels, purity 1 means no selected neighbour has another label."""
    b, n, d, k = 6, 20, 5, 4
    pred, target, bank = leaves((b, d), (b, d), (n, d), seed=21)
    ql = torch.tensor([0, 1, 2, 0, 1, 3])
    bl = _labels(n, 3, 0)
    planted = torch.cat([bank.detach(), target.detach()])  # one more row per query, at u_b ...
    planted_lab = torch.cat([bl, (ql + 1) % 4])  # ... with another label
    t = functional.cmsf_terms(pred, target, planted, k=k, query_labels=ql, bank_labels=planted_lab,
                              true_query_labels=ql, true_bank_labels=planted_lab)
    assert t["purity"].item() == 1.0
    sizes = torch.tensor([int((torch.cat([ql, planted_lab]) == ql[i]).sum()) for i in range(b)])  # batch, then bank
    torch.testing.assert_close(t["constrained_size"], sizes.double().mean().float())
    torch.testing.assert_close(t["neighbours"], sizes.clamp(max=k).double().mean().float())
    ref = ref_cmsf(pred, target, planted, k, ql, planted_lab)
    torch.testing.assert_close(t["loss"], ref)


def test_mask_excludes_the_nearest_candidate_even_below_k():
    u = torch.tensor([[1.0, 0.0]], dtype=F64)
    v = torch.tensor([[0.6, 0.8]], dtype=F64, requires_grad=True)
    copy, w = torch.tensor([1.0, 0.0], dtype=F64), _unit(torch.tensor([0.0, 1.0], dtype=F64))
    bank = torch.stack([copy, w])  # the masked-out row is an exact copy of u
    mask = torch.tensor([[True, False, True]])
    t = functional.cmsf_terms(v, u, bank, k=5, constraint_mask=mask)  # k > |M̂| = 2
    want = (((v[0] - u[0]) ** 2).sum() + ((v[0] - w) ** 2).sum()) / 2
    torch.testing.assert_close(t["loss"], want)
    assert t["neighbours"].item() == 2 and t["constrained_size"].item() == 2


def test_include_target_false_drops_u_only():
    u = torch.tensor([[1.0, 0.0]], dtype=F64)
    v = torch.tensor([[0.0, 1.0]], dtype=F64, requires_grad=True)
    near, far = _unit(torch.tensor([1.0, 0.2], dtype=F64)), _unit(torch.tensor([-1.0, 0.3], dtype=F64))
    bank = torch.stack([far, near])
    out = functional.cmsf_terms(v, u, bank, k=1, include_target=False)["loss"]  # S = {nearest other row}
    torch.testing.assert_close(out, ((v[0] - near) ** 2).sum())
    torch.testing.assert_close(functional.cmsf_terms(v, u, bank, k=1)["loss"], ((v[0] - u[0]) ** 2).sum())
    # alone in its class: no neighbour at all, a zero contribution (and zero gradient)
    alone = functional.cmsf_terms(v, u, bank, k=3, include_target=False, query_labels=torch.tensor([1]),
                                  bank_labels=torch.tensor([0, 0]))
    assert alone["loss"].item() == 0.0 and alone["neighbours"].item() == 0.0


def test_u_is_selected_first_even_against_a_duplicate():
    (v,) = leaves((3, 4), seed=1)
    (u,) = leaves((3, 4), seed=2)
    dup = u.detach().clone()  # bank rows equal to the queries' targets, different labels in purity
    t = functional.cmsf_terms(v, u, dup, k=1, true_query_labels=torch.arange(3), true_bank_labels=torch.arange(3) + 10)
    assert t["purity"].item() == 1.0  # the selected row is u_b itself, not its copy


# ---- diagnostics ------------------------------------------------------------------------------


def _deg(a):
    return [math.cos(math.radians(a)), math.sin(math.radians(a))]


def test_purity_on_a_hand_made_case():
    """Query 0 (noisy label 0) has label-0 rows at 10°, 20° (truly class 1) and 170° (truly class 1);
    query 1 (label 1) has one label-1 row at 100° and a label-2 row at 85° (closer, excluded)."""
    u = torch.tensor([_deg(0), _deg(90)], dtype=F64)
    bank = torch.tensor([_deg(10), _deg(20), _deg(170), _deg(100), _deg(85)], dtype=F64)
    ql, bl = torch.tensor([0, 1]), torch.tensor([0, 0, 0, 1, 2])
    tq, tb = torch.tensor([0, 1]), torch.tensor([0, 1, 1, 1, 1])
    kw = dict(query_labels=ql, bank_labels=bl, true_query_labels=tq, true_bank_labels=tb)
    top3 = functional.cmsf_terms(u, u, bank, k=3, **kw)  # S_0 = {u0, 10°, 20°}, S_1 = {u1, 100°}
    assert top3["purity"].item() == pytest.approx(4 / 5)
    assert top3["neighbours"].item() == pytest.approx(2.5)
    assert top3["constrained_size"].item() == pytest.approx(3.0)  # 4 and 2
    top_all = functional.cmsf_terms(u, u, bank, k=None, **kw)  # S_0 adds 170°: purity drops
    assert top_all["purity"].item() == pytest.approx(4 / 6)


# ---- cross-modal and semi-supervised constraints -------------------------------------------------


def test_topk_constraint_hand_made_and_in_the_loss():
    q = torch.tensor([[1.0, 0.0]])
    cands = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.9, 0.1], [-1.0, 0.0]])
    assert functional.topk_constraint(q, cands, 2).tolist() == [[True, False, True, False]]
    assert functional.topk_constraint(q, cands, 9).all()
    b, n, d = 5, 13, 4
    pred, target, bank = leaves((b, d), (b, d), (n, d), seed=4)
    aux, bank_aux = leaves((b, 3), (n, 3), seed=5)
    mask = functional.topk_constraint(aux, functional.cmsf_candidates(aux, bank_aux), 6)  # n = 6 > k = 3 (Tab. 4)
    assert mask.sum(1).eq(6).all() and mask[torch.arange(b), torch.arange(b)].all()  # the query is its own neighbour
    ours = functional.cmsf_terms(pred, target, bank, k=3, constraint_mask=mask)["loss"]
    assert_value_and_grads(ours, ref_cmsf(pred, target, bank, 3, mask=mask), [pred])


def test_semi_supervised_constraint_layout_and_limits():
    ql = torch.tensor([2, functional.UNLABELLED, 2])
    lab_bank = torch.tensor([2, 0, 2])
    mask = functional.semi_supervised_constraint(ql, lab_bank, 4)
    assert mask.tolist() == [
        [True, False, True] + [True, False, True] + [False] * 4,  # labelled: same-label batch and labelled bank
        [True, True, True] + [False] * 3 + [True] * 4,  # unlabelled: whole batch, unlabelled bank (MSF)
        [True, False, True] + [True, False, True] + [False] * 4,
    ]
    b, d = 6, 5
    pred, target, lab, unl = leaves((b, d), (b, d), (8, d), (10, d), seed=9)
    lab_labels = _labels(8, 3, 1)
    both = torch.cat([lab, unl])
    labelled = _labels(b, 3, 2)
    semi = functional.cmsf_terms(pred, target, both, k=3,
                                constraint_mask=functional.semi_supervised_constraint(labelled, lab_labels, 10))["loss"]
    supervised = functional.cmsf_terms(pred, target, lab, k=3, query_labels=labelled, bank_labels=lab_labels)["loss"]
    torch.testing.assert_close(semi, supervised)
    none = torch.full((b,), functional.UNLABELLED)
    semi = functional.cmsf_terms(pred, target, both, k=3,
                                constraint_mask=functional.semi_supervised_constraint(none, lab_labels, 10))["loss"]
    torch.testing.assert_close(semi, functional.cmsf_terms(pred, target, unl, k=3)["loss"])


# ---- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,match", [
    ({"k": 0}, "k must be a positive integer"),
    ({"k": -2}, "k must be a positive integer"),
    ({"k": 2.5}, "k must be a positive integer"),
    ({"k": True}, "k must be a positive integer"),
    ({"query_labels": torch.zeros(3, dtype=torch.long)}, "given together"),
    ({"bank_labels": torch.zeros(4, dtype=torch.long)}, "given together"),
    ({"query_labels": torch.zeros(2, dtype=torch.long), "bank_labels": torch.zeros(4, dtype=torch.long)}, r"\[B=3\]"),
    ({"true_query_labels": torch.zeros(3, dtype=torch.long)}, "given together"),
    ({"constraint_mask": torch.ones(3, 4, dtype=torch.bool)}, "constraint_mask must be"),
    ({"constraint_mask": torch.ones(3, 7)}, "constraint_mask must be"),
])
def test_one_line_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        functional.cmsf_terms(torch.randn(3, 5), torch.randn(3, 5), torch.randn(4, 5), **kwargs)
    assert "\n" not in str(err.value)


def test_shape_errors():
    for args, match in [((torch.randn(3, 5), torch.randn(2, 5), torch.randn(4, 5)), "same shape"),
                        ((torch.randn(3, 5), torch.randn(3, 5), torch.randn(4, 6)), "bank must be"),
                        ((torch.randn(3, 5), torch.randn(3, 5), torch.randn(4)), "bank must be"),
                        ((torch.randn(5), torch.randn(5), torch.randn(4, 5)), "2-D")]:
        with pytest.raises(ValueError, match=match) as err:
            functional.cmsf_terms(*args)["loss"]
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="k_prime"):
        functional.topk_constraint(torch.randn(2, 3), torch.randn(4, 3), 0)
    with pytest.raises(ValueError, match="share Da"):
        functional.topk_constraint(torch.randn(2, 3), torch.randn(4, 2), 1)


def test_float32_collapsed_inputs():
    x = torch.ones(4, 8, requires_grad=True)
    t = functional.cmsf_terms(x, x.detach(), torch.ones(10, 8), k=3)
    t["loss"].backward()
    assert t["loss"].abs().item() < 1e-6 and torch.isfinite(x.grad).all()


# ---- memory bank -------------------------------------------------------------------------------


def _batch(ids, d=3):
    """Rows that identify themselves: row i points along a direction set by its id, label = id."""
    ids = torch.as_tensor(ids)
    x = torch.stack([torch.tensor([1.0, float(i), float(i) ** 2 / 10]) for i in ids.tolist()])[:, :d]
    return x.double(), ids


@pytest.mark.parametrize("size,batches", [(5, [2, 2, 2, 2, 1]), (4, [4, 4, 1, 3]), (3, [5, 1, 7]), (6, [1, 2, 3, 4])])
def test_bank_is_fifo_with_wrap_around(size, batches):
    bank = MemoryBank(3, size, dtype=F64)
    seen, start = [], 0
    for n in batches:
        x, ids = _batch(range(start, start + n))
        bank.enqueue(x, ids)
        seen += ids.tolist()
        start += n
        view = bank.view()
        assert view.labels.tolist() == seen[-size:]  # oldest first, the oldest evicted
        torch.testing.assert_close(view.embeddings, _unit(_batch(seen[-size:])[0]))
        assert int(bank.filled) == min(len(seen), size) and int(bank.ptr) == len(seen) % size


def test_bank_labels_aux_keep_and_checkpoint():
    bank = MemoryBank(3, 4, aux_dim=2, dtype=F64)
    x, ids = _batch([0, 1, 2])
    aux = torch.stack([ids.double() + 1, -ids.double()], 1)
    bank.enqueue(x, None, aux)
    assert bank.view().labels.tolist() == [NO_LABEL] * 3
    x2, ids2 = _batch([3, 4, 5])
    bank.enqueue(x2, ids2, aux[[2, 1, 0]], keep=torch.tensor([True, False, True]))
    view = bank.view()
    assert view.labels.tolist() == [NO_LABEL, NO_LABEL, 3, 5]
    torch.testing.assert_close(view.aux, _unit(torch.stack([aux[1], aux[2], aux[2], aux[0]])))
    assert set(bank.state_dict()) == {"bank", "labels", "ptr", "filled", "aux"}
    restored = MemoryBank(3, 4, aux_dim=2, dtype=F64)
    restored.load_state_dict(bank.state_dict())
    for a, b in zip(restored.view(), view):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="aux must be given"):
        bank.enqueue(x, ids)
    with pytest.raises(ValueError, match="D=3"):
        MemoryBank(3, 4).enqueue(torch.randn(2, 4))
    with pytest.raises(ValueError, match="size must be positive"):
        MemoryBank(3, 0)
    assert MemoryBank(8).bank.shape == (128_000, 8)


# ---- momentum encoder ----------------------------------------------------------------------------


def _net(seed):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)).double()
    net(torch.randn(6, 4, dtype=F64))  # non-trivial running statistics
    return net


@pytest.mark.parametrize("m", [0.0, 0.99, 0.7, 1.0])
def test_momentum_update_is_the_ema(m):
    target, online = _net(0), _net(1)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    momentum_update(target, online, m)
    for name, p in target.named_parameters():
        want = m * before[name] + (1 - m) * dict(online.named_parameters())[name]
        torch.testing.assert_close(p, want, rtol=0, atol=1e-15)
    for name, buf in target.named_buffers():
        assert torch.equal(buf, dict(online.named_buffers())[name])
    with pytest.raises(ValueError, match="momentum m"):
        momentum_update(target, online, 1.5)
    with pytest.raises(ValueError, match="different parameters"):
        momentum_update(target, torch.nn.Linear(4, 3), 0.9)


def test_momentum_schedules():
    assert momentum_at(0, 100) == momentum_at(73, 100) == 0.99
    assert momentum_at(0, 100, 0.996, "cosine") == pytest.approx(0.996)
    assert momentum_at(50, 100, 0.996, "cosine") == pytest.approx(1 - 0.004 / 2)
    assert momentum_at(100, 100, 0.996, "cosine") == pytest.approx(1.0)
    assert momentum_at(250, 100, 0.996, "cosine") == pytest.approx(1.0)
    ms = [momentum_at(s, 40, 0.9, "cosine") for s in range(41)]
    assert all(a <= b for a, b in zip(ms, ms[1:]))
    bad = [((0, 10, 0.9, "linear"), "schedule"), ((0, 0), "total"), ((-1, 10), "step"), ((0, 10, 1.2), "base")]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            momentum_at(*args)


# ---- 2 ranks (gloo) against 1 process, float64 ---------------------------------------------------


def _two_rank_cmsf(rank, world):
    import torch.distributed as dist

    g = torch.Generator().manual_seed(17)
    b, n, d = 3, 10, 5
    pred, target = torch.randn(b * world, d, generator=g, dtype=F64), torch.randn(b * world, d, generator=g, dtype=F64)
    bank, aux, bank_aux = (torch.randn(n, d, generator=g, dtype=F64), torch.randn(b * world, 4, generator=g, dtype=F64),
                           torch.randn(n, 4, generator=g, dtype=F64))
    ql, bl = torch.randint(0, 2, (b * world,), generator=g), torch.randint(0, 2, (n,), generator=g)
    sl = slice(rank * b, (rank + 1) * b)
    cases = {
        "supervised": lambda lab, mask: dict(k=3, query_labels=lab, bank_labels=bl,
                                             true_query_labels=lab, true_bank_labels=bl),
        "msf_top_all": lambda lab, mask: dict(k=None),
        "no_target": lambda lab, mask: dict(k=2, include_target=False, query_labels=lab, bank_labels=bl),
        "cross_modal": lambda lab, mask: dict(k=2, constraint_mask=mask),
    }
    out = {}
    for name, kw in cases.items():
        leaf = pred.clone().requires_grad_()
        mask = functional.topk_constraint(aux[sl], functional.cmsf_candidates(aux[sl], bank_aux), 5)
        terms = functional.cmsf_terms(leaf[sl], target[sl], bank, **kw(ql[sl], mask))
        terms["loss"].backward()
        ref_leaf = pred.clone().requires_grad_()
        ref_mask = functional.topk_constraint(aux, torch.cat([aux, bank_aux]), 5)
        ref = functional.cmsf_terms(ref_leaf, target, bank, global_batch=False, **kw(ql, ref_mask))
        ref["loss"].backward()
        torch.testing.assert_close(mask, ref_mask[sl], msg=f"{name} mask")
        # loss and diagnostics: per-rank means over equal halves average to the whole batch's (purity is a
        # pooled share per rank: equal here because every row of the supervised case uses its k neighbours)
        for key in ref:
            mean = terms[key].detach().clone().double()
            dist.all_reduce(mean)
            torch.testing.assert_close(mean / world, ref[key].detach().double(), rtol=1e-10, atol=1e-12,
                                       msg=f"{name} {key}")
        grad = leaf.grad.clone()
        dist.all_reduce(grad)  # DDP averages the parameter gradients over ranks
        torch.testing.assert_close(grad / world, ref_leaf.grad, rtol=1e-10, atol=1e-12, msg=f"{name} grad")
        out[name] = terms["loss"].detach()
    semi_labels = torch.where(ql == 0, functional.UNLABELLED, ql)  # class 0 plays the unlabelled rows
    semi = functional.semi_supervised_constraint(semi_labels[sl], bl, 7)
    ref_semi = functional.semi_supervised_constraint(semi_labels, bl, 7, global_batch=False)
    assert torch.equal(semi, ref_semi[sl])
    mem, ref_mem = MemoryBank(d, 8, aux_dim=4, dtype=F64), MemoryBank(d, 8, aux_dim=4, dtype=F64)
    for step in range(3):  # 6 rows a step into 8: wraps around
        mem.enqueue(target[sl] + step, ql[sl], aux[sl])
        ref_mem.enqueue(target + step, ql, aux, global_batch=False)
    for a, r in zip(mem.view(), ref_mem.view()):
        torch.testing.assert_close(a, r, rtol=0, atol=0)
    return {"view": mem.view(), "state": mem.state_dict(), "losses": out}


@pytest.mark.slow
def test_two_ranks_match_one_process():
    r0, r1 = run_ranks(_two_rank_cmsf, 2)
    for key in r0["state"]:  # the banks are identical on both ranks after the enqueues
        assert torch.equal(r0["state"][key], r1["state"][key]), key
    assert int(r0["state"]["filled"]) == 8 and int(r0["state"]["ptr"]) == 18 % 8
