"""unified (App. A, Alg. 1), yCLIP (App. B.2), SigLIP/xSigLIP and the nCLIP-head diagnostics,
against float64 transcriptions written from the papers, plus a 2-rank gloo check."""

import pytest
import torch

from nclip.objectives import REGISTRY, build_objective, functional
from nclip.objectives.siglip import SiglipConfig, XsiglipConfig
from nclip.objectives.unified import TABLE_A1_SETTINGS, UnifiedConfig, UnifiedObjective
from nclip.objectives.yclip import YclipConfig

from distributed_utils import run_ranks
from references import (
    assert_value_and_grads,
    encoder_output,
    leaves,
    ref_siglip,
    ref_swav_sinkhorn,
    ref_unified,
    ref_yclip,
)

# ---- Sinkhorn ----------------------------------------------------------------------------------


@pytest.mark.parametrize("b,k,eps,iters", [(6, 4, 0.5, 3), (16, 10, 0.05, 3), (5, 12, 1.0, 1)])
def test_sinkhorn_matches_swav_code(b, k, eps, iters):
    (x,) = leaves((b, k), seed=b + k)
    torch.testing.assert_close(functional.sinkhorn(x, iters, eps), ref_swav_sinkhorn(x.detach(), eps, iters),
                               rtol=1e-10, atol=1e-13)


def test_sinkhorn_marginals_swav_convention():
    # rows (samples) sum to exactly 1; columns (prototypes) to B/K, reached as iterations grow
    (x,) = leaves((12, 5), seed=1, scale=2.0)
    errs = []
    for iters in (1, 3, 10, 100):
        q = functional.sinkhorn(x, iters, 0.5)
        assert not q.requires_grad
        torch.testing.assert_close(q.sum(1), torch.ones(12, dtype=q.dtype), rtol=0, atol=1e-12)
        errs.append((q.sum(0) - 12 / 5).abs().max().item())
    assert errs[-1] < 1e-9 and errs[0] > errs[1] > errs[2]


def test_sinkhorn_extreme_logits_and_batch_of_one():
    g = torch.Generator().manual_seed(0)
    x = 1e4 * torch.randn(9, 7, generator=g)  # float32, exp(x/ε) would overflow
    q = functional.sinkhorn(x, 3, 0.05)
    assert torch.isfinite(q).all() and torch.allclose(q.sum(1), torch.ones(9), atol=1e-5)
    q1 = functional.sinkhorn(torch.randn(1, 6, generator=g), 3, 0.05)  # one sample must spread uniformly
    torch.testing.assert_close(q1, torch.full((1, 6), 1 / 6))
    with pytest.raises(ValueError, match="n_iters"):
        functional.sinkhorn(x, 0)


# ---- unified objective -----------------------------------------------------------------------


def test_unified_nclip_row_is_nclip():
    h_i, h_t = leaves((7, 12), (7, 12), seed=2, scale=2.0)
    cfg = TABLE_A1_SETTINGS["nCLIP"]
    ours = functional.unified_terms(h_i, h_t, cfg["tau_s"], cfg["tau"], cfg["lambda1"], cfg["lambda2"])["loss"]
    assert_value_and_grads(ours, functional.nclip_terms(h_i, h_t, 0.5, 1.5)["loss"], [h_i, h_t])


@pytest.mark.parametrize("uniform", ["none", "sinkhorn", "batch_softmax", "centering"])
@pytest.mark.parametrize("seed,b,k", [(0, 1, 5), (1, 6, 9), (2, 11, 16)])
def test_unified_matches_algorithm1(uniform, seed, b, k):
    g = torch.Generator().manual_seed(seed + 50)
    tau_s, tau = 0.2 + float(torch.rand(1, generator=g)), 0.5 + float(torch.rand(1, generator=g))
    lam1, lam2 = float(torch.rand(1, generator=g)), 1 + float(torch.rand(1, generator=g))
    h_i, h_t = leaves((b, k), (b, k), seed=seed, scale=2.0)
    kw, ref_kw = {"uniform": uniform, "sinkhorn_iters": 4}, {"iters": 4}
    wrt = [h_i, h_t]
    if uniform == "centering":  # (running mean, running variance, learnable scale) per modality
        ci, ct = ((torch.randn(k, generator=g, dtype=torch.float64),
                   torch.rand(k, generator=g, dtype=torch.float64) + 0.5,
                   (torch.rand(k, generator=g, dtype=torch.float64) + 0.5).requires_grad_()) for _ in range(2))
        kw.update(image_center=ci, text_center=ct)
        ref_kw.update(ci=ci, ct=ct)
        wrt += [ci[2], ct[2]]  # gradients of the scale parameters too
    ours = functional.unified_terms(h_i, h_t, tau_s, tau, lam1, lam2, **kw)["loss"]
    ref = ref_unified(h_i, h_t, tau_s, tau, lam1, lam2, uniform, **ref_kw)
    assert_value_and_grads(ours, ref, wrt)


def test_unified_terms_and_stop_grad():
    h_i, h_t = leaves((8, 6), (8, 6), seed=3)
    t = functional.unified_terms(h_i, h_t, 0.5, 1.0, 0.3, 1.2, uniform="sinkhorn")
    torch.testing.assert_close(t["loss"], t["ce"] + 0.3 * t["eh"] - 1.2 * t["he"])
    torch.testing.assert_close(t["kl"], (t["ce"] - t["eh"]).detach())
    # L_HE keeps a gradient through the Sinkhorn target (Tab. A1 footnote *), none when detached
    (g_he,) = torch.autograd.grad(t["he"], [h_i], allow_unused=True)
    assert g_he is not None and g_he.abs().sum() > 0
    t = functional.unified_terms(h_i, h_t, 0.5, 1.0, 0.3, 1.2, uniform="sinkhorn", stop_grad_target=True)
    assert not t["eh"].requires_grad and not t["he"].requires_grad
    # the target's value is exactly SwAV's Sinkhorn output on softmax(f/τ_s)
    log_p = functional.unified_target_log_prob(h_i, 0.5, "sinkhorn", sinkhorn_iters=3)
    ref = ref_swav_sinkhorn(torch.log_softmax(h_i.detach() / 0.5, 1), 1.0, 3)
    torch.testing.assert_close(log_p.exp(), ref)


def test_table_a1_rows_build_and_validate():
    assert set(TABLE_A1_SETTINGS) >= {"CE", "SwAV", "SCSF", "DINO", "MSN", "nCLIP"}
    assert UnifiedConfig.from_table_a1("SwAV").uniform == "sinkhorn"
    assert UnifiedConfig.from_table_a1("DINO", center_momentum=0.5).center_momentum == 0.5
    h = torch.randn(4, 8)
    for row in TABLE_A1_SETTINGS:
        obj = build_objective(UnifiedConfig.from_table_a1(row))
        assert torch.isfinite(obj(encoder_output(h, h.roll(1, 0)))["loss"])
    with pytest.raises(ValueError, match="unknown Tab. A1 row"):
        UnifiedConfig.from_table_a1("BYOL")
    with pytest.raises(ValueError):
        UnifiedConfig(uniform="sinkhorn", typo=1)
    with pytest.raises(ValueError):
        UnifiedConfig(tau_s=0)


def test_centering_running_statistics():
    cfg = UnifiedConfig.from_table_a1("DINO", center_momentum=0.8)
    obj = UnifiedObjective(cfg).train()
    g = torch.Generator().manual_seed(4)
    stats = {side: (torch.zeros(6, dtype=torch.float64), torch.ones(6, dtype=torch.float64),
                    getattr(obj, f"center_scale_{side}")) for side in ("image", "text")}
    for _ in range(3):
        h_i, h_t = (3 * torch.randn(5, 6, generator=g, dtype=torch.float64) + 1 for _ in range(2))
        h_i.requires_grad_()
        loss = obj(encoder_output(h_i, h_t))["loss"]
        # the loss of this batch uses the statistics from before it (DINO's update order)
        torch.testing.assert_close(loss, ref_unified(h_i, h_t, 0.7, 1.0, 0.0, 0.0, "centering",
                                                     ci=stats["image"], ct=stats["text"]))
        loss.backward()  # the in-place buffer update must not break autograd
        for side, h in (("image", h_i.detach()), ("text", h_t)):
            mean, var, scale = stats[side]  # C <- m C + (1 - m) batch statistic, population variance
            stats[side] = (0.8 * mean + 0.2 * h.mean(0), 0.8 * var + 0.2 * h.var(0, unbiased=False), scale)
            torch.testing.assert_close(getattr(obj, f"center_mean_{side}"), stats[side][0])
            torch.testing.assert_close(getattr(obj, f"center_var_{side}"), stats[side][1])
    obj.eval()
    before = obj.center_mean_image.clone()
    obj(encoder_output(h_i.detach(), h_t))
    torch.testing.assert_close(obj.center_mean_image, before)  # no update in eval mode
    fresh = UnifiedObjective(cfg)
    fresh.load_state_dict(obj.state_dict())  # lazily sized buffers restore from a checkpoint
    torch.testing.assert_close(fresh.center_var_text, obj.center_var_text)
    assert "center_mean_image" not in UnifiedObjective(UnifiedConfig()).state_dict()


def test_centering_changes_the_target_of_logits_that_are_not_standardised():
    # Tab. A1 †: p = softmax(γ ⊙ (f − μ) / sqrt(v + ε) / τ_s) (App. A: running variance and scale parameters)
    g = torch.Generator().manual_seed(7)
    f = 3 * torch.randn(9, 6, generator=g, dtype=torch.float64) + 2
    mean, var = functional.batch_moments(f)
    ones = torch.ones(6, dtype=torch.float64)
    log_p = functional.unified_target_log_prob(f, 0.7, "centering", center=(mean, var, ones))
    std = (f - f.mean(0)) / torch.sqrt(f.var(0, unbiased=False) + 1e-5)
    torch.testing.assert_close(log_p, torch.log_softmax(std / 0.7, 1))
    assert (log_p - torch.log_softmax(f / 0.7, 1)).abs().max() > 0.1
    # on standardised logits the statistics are the identity and the scale parameters still act
    gamma = torch.linspace(0.5, 2.0, 6, dtype=torch.float64)
    scaled = functional.unified_target_log_prob(std, 0.7, "centering", center=(0 * ones, ones, gamma), center_eps=0)
    torch.testing.assert_close(scaled, torch.log_softmax(gamma * std / 0.7, 1))
    with pytest.raises(ValueError, match="running_mean, running_var, scale"):
        functional.unified_target_log_prob(f, 0.7, "centering", center=(mean, var))


def test_centering_row_differs_from_tau_s_only_row_on_batchnormed_logits():
    """Issue 15: the nCLIP head ends in BatchNorm1d(affine=False), so the running mean/variance
    converge to 0/1 and centering by them alone is the identity: Tab. A1's DINO row was the same loss
    as its τ_s-only twin (uniform='none') to 1e-6. The scale parameters of App. A are trained and
    make the rows differ."""
    from types import SimpleNamespace

    k = 8
    bn = torch.nn.BatchNorm1d(k, affine=False).train()
    g = torch.Generator().manual_seed(8)
    batches = [(bn(3 * torch.randn(16, k, generator=g) + 1), bn(2 * torch.randn(16, k, generator=g) - 1))
               for _ in range(20)]
    run_cfg = SimpleNamespace(model=SimpleNamespace(nclip_dim=k))
    dino = build_objective(UnifiedConfig.from_table_a1("DINO"), run_cfg).train()
    tau_s_only = build_objective(UnifiedConfig.from_table_a1("DINO", uniform="none")).train()
    scales = [p for n, p in dino.named_parameters() if n.startswith("center_scale")]
    assert len(scales) == 2 and all(p.shape == (k,) and bool((p == 1).all()) for p in scales)  # γ = 1 at start
    h_i, h_t = batches[0]
    torch.testing.assert_close(dino(encoder_output(h_i, h_t))["loss"], tau_s_only(encoder_output(h_i, h_t))["loss"])
    opt = torch.optim.SGD(dino.parameters(), lr=1.0)
    for h_i, h_t in batches[1:]:
        opt.zero_grad()
        dino(encoder_output(h_i.detach(), h_t.detach()))["loss"].backward()
        opt.step()
    # the running statistics of BN outputs are (close to) the identity ...
    torch.testing.assert_close(dino.center_mean_image, torch.zeros(k), atol=1e-6, rtol=0)
    torch.testing.assert_close(dino.center_var_image, torch.ones(k), atol=0.1, rtol=0)
    # ... and the trained scales make the row differ from the τ_s-only row on the same inputs
    h_i, h_t = (x.detach() for x in batches[0])
    d = dino.eval()(encoder_output(h_i, h_t))["loss"] - tau_s_only.eval()(encoder_output(h_i, h_t))["loss"]
    assert abs(float(d.detach())) > 1e-3
    frozen = UnifiedObjective(UnifiedConfig.from_table_a1("DINO", stop_grad_target=True), k)
    assert not any(p.requires_grad for p in frozen.parameters())  # no gradient reaches γ through a detached target


@pytest.mark.parametrize("magnitude", [1e2, 1e4])
def test_unified_yclip_siglip_finite_for_extreme_inputs(magnitude):
    g = torch.Generator().manual_seed(5)
    for b in (1, 6):
        h_i = (magnitude * torch.randn(b, 32, generator=g)).requires_grad_()
        h_t = (magnitude * torch.randn(b, 32, generator=g)).requires_grad_()
        losses = [
            functional.unified_terms(h_i, h_t, 0.25, 1.0, 0.5, 1.5, uniform=u,
                                    image_center=(torch.zeros(32), torch.zeros(32), torch.ones(32)),
                                    text_center=(torch.zeros(32), torch.zeros(32), torch.ones(32)))["loss"]
            for u in functional.UNIFORM_CHOICES
        ]
        losses += [functional.yclip_terms(h_i, h_t, torch.tensor(100.0))["loss"],
                   functional.siglip_terms(h_i, h_t, torch.tensor(100.0), -10.0)["loss"]]
        for loss in losses:
            gi, gt = torch.autograd.grad(loss, [h_i, h_t])
            assert torch.isfinite(loss) and torch.isfinite(gi).all() and torch.isfinite(gt).all()


# ---- yCLIP -----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed,b,k,lam1,lam2", [(0, 1, 4, 0.5, 1.5), (1, 5, 8, 0.0, 0.0), (2, 9, 6, 3.0, 4.0)])
def test_yclip_matches_eq2_eq3(seed, b, k, lam1, lam2):
    h_i, h_t = leaves((b, k), (b, k), seed=seed, scale=2.0)
    scale = torch.tensor(7.0, dtype=torch.float64, requires_grad=True)
    ours = functional.yclip_terms(h_i, h_t, scale, lam1, lam2)["loss"]
    assert_value_and_grads(ours, ref_yclip(h_i, h_t, scale, lam1, lam2), [h_i, h_t, scale])


def test_yclip_module_terms():
    h_i, h_t = leaves((6, 10), (6, 10), seed=6)
    obj = build_objective(YclipConfig(lambda1=0.5, lambda2=1.5))
    assert obj.heads == frozenset({"nclip"}) and obj.zero_shot == "yclip"  # scored with its S
    t = obj(encoder_output(h_i, h_t, scale=5.0))
    p, q = torch.softmax(h_i, 1), torch.softmax(h_t, 1)
    ce = -((p * q.log()).sum(1) + (q * p.log()).sum(1)).mean() / 2
    torch.testing.assert_close(t["yclip/L_CE"], ce.detach())
    for key in ("L_NCE", "L_EH", "L_HE", "L_KL", "acc_i2t", "acc_nC", "row_std", "col_std", "usage"):
        assert f"yclip/{key}" in t


# ---- SigLIP ----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed,b,d", [(0, 1, 3), (1, 6, 5), (2, 10, 4)])
def test_siglip_matches_paper(seed, b, d):
    x, y = leaves((b, d), (b, d), seed=seed)
    t = torch.tensor(10.0, dtype=torch.float64, requires_grad=True)
    bias = torch.tensor(-3.0, dtype=torch.float64, requires_grad=True)
    assert_value_and_grads(functional.siglip_terms(x, y, t, bias)["loss"], ref_siglip(x, y, t, bias), [x, y, t, bias])


def test_siglip_and_xsiglip_modules():
    g_i, g_t, h_i, h_t = leaves((5, 4), (5, 4), (5, 7), (5, 7), seed=8)
    sig = build_objective(SiglipConfig())
    assert isinstance(sig.logit_bias, torch.nn.Parameter) and sig.logit_bias.item() == -10.0
    assert any(p is sig.logit_bias for p in sig.parameters())
    out = encoder_output(h_i, h_t, g_i, g_t, scale=14.0)
    t = sig(out)
    torch.testing.assert_close(t["loss"], ref_siglip(g_i, g_t, torch.tensor(14.0, dtype=torch.float64), -10.0))
    t["loss"].backward()
    assert sig.logit_bias.grad is not None
    x = build_objective(XsiglipConfig(w_clip=0.3, w_nclip=0.9, lambda1=0.2, lambda2=1.2))
    assert x.heads == frozenset({"clip", "nclip"}) and x.zero_shot == "clip"
    ref = (0.3 * ref_siglip(g_i, g_t, torch.tensor(14.0, dtype=torch.float64), -10.0)
           + 0.9 * functional.nclip_terms(h_i, h_t, 0.2, 1.2)["loss"])
    torch.testing.assert_close(x(out)["loss"], ref)


# ---- diagnostics -----------------------------------------------------------------------------


def test_distribution_diagnostics_definitions():
    h_i = torch.tensor([[5.0, 0.0, 0.0, 0.0], [0.0, 5.0, 0.0, 0.0], [5.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    h_t = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 2.0, 0.0], [3.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    d = functional.distribution_diagnostics(h_i, h_t)
    p = torch.softmax(h_i, 1)
    row = torch.stack([torch.sqrt(((r - r.mean()) ** 2).mean()) for r in p]).mean()
    col = torch.stack([torch.sqrt(((c - c.mean()) ** 2).mean()) for c in p.T]).mean()
    assert d["acc_nC"].item() == pytest.approx(2 / 3)
    torch.testing.assert_close(d["row_std"], row)
    torch.testing.assert_close(d["col_std"], col)
    assert d["usage"].item() == pytest.approx(2 / 4)  # prototypes 0 and 1
    flat = functional.distribution_diagnostics(torch.zeros(1, 8), torch.zeros(1, 8))  # batch of one, uniform
    assert flat["row_std"].item() == 0 and flat["col_std"].item() == 0 and flat["usage"].item() == 1 / 8


@pytest.mark.parametrize("name", ["nclip", "xclip", "unified", "xsiglip"])
def test_modules_report_diagnostics(name):
    g_i, g_t, h_i, h_t = leaves((4, 3), (4, 3), (4, 6), (4, 6), seed=9)
    terms = build_objective(REGISTRY[name][0]())(encoder_output(h_i, h_t, g_i, g_t))
    prefix = "unified" if name == "unified" else "nclip"
    for key in ("L_CE", "L_EH", "L_HE", "L_KL", "acc_nC", "row_std", "col_std", "logit_row_std", "logit_col_std",
                "usage"):
        assert f"{prefix}/{key}" in terms
    assert not terms[f"{prefix}/usage"].requires_grad


@pytest.mark.parametrize("name", ["nclip", "xclip", "unified", "yclip"])
def test_logged_logit_column_std_of_a_batchnormed_batch_is_one(name):
    """Fig. B1 (a): "Std converges to 1 if training is stable due to Batch Normalization" holds for
    the logits (the head's last BN(affine=False) standardises every column of a training batch), not
    for the probabilities P, whose columns have std <= 1/2."""
    k, b = 16, 32
    bn = torch.nn.BatchNorm1d(k, affine=False).train()
    g = torch.Generator().manual_seed(10)
    h_i, h_t = (bn(4 * torch.randn(b, k, generator=g) + 2).detach() for _ in range(2))
    g_i, g_t = (torch.randn(b, 5, generator=g) for _ in range(2))
    terms = build_objective(REGISTRY[name][0]())(encoder_output(h_i, h_t, g_i, g_t))
    prefix = REGISTRY[name][1].head_stats_prefix
    assert abs(terms[f"{prefix}/logit_col_std"].item() - 1) < 1e-3
    assert terms[f"{prefix}/col_std"].item() < 0.5
    # the row std of the logits is the population std over the K prototypes of each row
    row = torch.stack([torch.sqrt(((r - r.mean()) ** 2).mean()) for r in h_i]).mean()
    torch.testing.assert_close(terms[f"{prefix}/logit_row_std"], row)


# ---- 2 ranks (gloo) against 1 process, float64: losses, gradients, statistics ----------------


def _two_rank_checks(rank, world):
    """Runs on each of 2 gloo ranks (tests/distributed_utils.run_ranks); asserts inside."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(123)
    b = 3  # local rows
    full = {n: torch.randn(b * world, d, generator=g, dtype=torch.float64)
            for n, d in (("hi", 7), ("ht", 7), ("gi", 4), ("gt", 4))}
    scale = torch.tensor(6.0, dtype=torch.float64)
    bias = torch.tensor(-2.0, dtype=torch.float64)
    cases = {
        "sinkhorn": lambda hi, ht, gi, gt, s, c, gb: functional.unified_terms(
            hi, ht, 0.5, 1.0, 0.2, 1.0, uniform="sinkhorn", global_batch=gb)["loss"],
        "batch_softmax": lambda hi, ht, gi, gt, s, c, gb: functional.unified_terms(
            hi, ht, 0.5, 1.0, 0.3, 1.3, uniform="batch_softmax", global_batch=gb)["loss"],
        "yclip": lambda hi, ht, gi, gt, s, c, gb: functional.yclip_terms(hi, ht, s, 0.5, 1.5, global_batch=gb)["loss"],
        "siglip": lambda hi, ht, gi, gt, s, c, gb: functional.siglip_terms(gi, gt, s, c, global_batch=gb)["loss"],
    }
    sl = slice(rank * b, (rank + 1) * b)
    for name, fn in cases.items():
        leaves = {k: v.clone().requires_grad_() for k, v in full.items()}
        s, c = scale.clone().requires_grad_(), bias.clone().requires_grad_()
        loss = fn(*(leaves[k][sl] for k in ("hi", "ht", "gi", "gt")), s, c, True)
        loss.backward()
        ref_leaves = {k: v.clone().requires_grad_() for k, v in full.items()}
        rs, rc = scale.clone().requires_grad_(), bias.clone().requires_grad_()
        ref = fn(*(ref_leaves[k] for k in ("hi", "ht", "gi", "gt")), rs, rc, False)
        ref.backward()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        torch.testing.assert_close(mean_loss / world, ref.detach(), msg=f"{name} loss")
        for k in leaves:  # DDP averages the parameter gradients over ranks
            gsum = leaves[k].grad if leaves[k].grad is not None else torch.zeros_like(full[k])
            dist.all_reduce(gsum)
            want = ref_leaves[k].grad if ref_leaves[k].grad is not None else torch.zeros_like(full[k])
            torch.testing.assert_close(gsum / world, want, msg=f"{name} grad {k}")
        for mine, want in ((s, rs), (c, rc)):
            gm = mine.grad.clone() if mine.grad is not None else torch.zeros(())
            dist.all_reduce(gm)
            torch.testing.assert_close(gm / world, want.grad if want.grad is not None else torch.zeros(()),
                                       msg=f"{name} scalar grad")
    # Sinkhorn codes and diagnostics are global-batch quantities
    torch.testing.assert_close(functional.sinkhorn(full["hi"][sl], 3, 0.3),
                               functional.sinkhorn(full["hi"], 3, 0.3, global_batch=False)[sl])
    d_loc = functional.distribution_diagnostics(full["hi"][sl], full["ht"][sl])
    d_ref = functional.distribution_diagnostics(full["hi"], full["ht"], global_batch=False)
    for k in d_ref:
        torch.testing.assert_close(d_loc[k], d_ref[k], msg=f"diagnostic {k}")
    # centering statistics are all-reduced: after two steps every rank holds the full-batch values
    objs = [UnifiedObjective(UnifiedConfig.from_table_a1("DINO", global_batch=gb)).train() for gb in (True, False)]
    for _ in range(2):
        objs[0](encoder_output(full["hi"][sl], full["ht"][sl]))
        objs[1](encoder_output(full["hi"], full["ht"]))
        full = {k: 2 * v + 1 for k, v in full.items()}
    for buf in ("center_mean_image", "center_var_image", "center_mean_text", "center_var_text"):
        torch.testing.assert_close(getattr(objs[0], buf), getattr(objs[1], buf), msg=buf)


@pytest.mark.slow
def test_two_ranks_match_one_process():
    run_ranks(_two_rank_checks, 2)
