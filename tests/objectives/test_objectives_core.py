"""clip / nclip / xclip against float64 transcriptions of the paper's equations (Eq. 1-5, Alg. 1)."""

import math

import pytest
import torch

from nclip.objectives import functional

from references import leaves, ref_clip, ref_nclip, ref_nclip_score, ref_yclip_score


@pytest.mark.parametrize("seed,b,d", [(0, 1, 3), (1, 5, 8), (2, 16, 4)])
def test_clip_loss_matches_eq1_values_and_grads(seed, b, d):
    g_i, g_t = leaves((b, d), (b, d), seed=seed)
    scale = torch.tensor(1 / 0.07, dtype=torch.float64, requires_grad=True)
    ours = functional.clip_terms(g_i, g_t, scale)["loss"]
    ref = ref_clip(g_i, g_t, scale)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)
    ga = torch.autograd.grad(ours, [g_i, g_t, scale])
    gb = torch.autograd.grad(ref, [g_i, g_t, scale])
    for a, r in zip(ga, gb):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("seed,b,k", [(0, 1, 7), (3, 6, 32), (4, 13, 100)])
def test_nclip_loss_matches_algorithm1_values_and_grads(seed, b, k):
    g = torch.Generator().manual_seed(seed + 100)
    lam1, lam2 = float(torch.rand(1, generator=g)) * 2, float(torch.rand(1, generator=g)) * 3
    h_i, h_t = leaves((b, k), (b, k), seed=seed, scale=3.0)
    ours = functional.nclip_terms(h_i, h_t, lam1, lam2)["loss"]
    ref = ref_nclip(h_i, h_t, lam1, lam2)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)
    for a, r in zip(torch.autograd.grad(ours, [h_i, h_t]), torch.autograd.grad(ref, [h_i, h_t])):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-12)


def test_nclip_terms_are_the_symmetrised_means():
    h_i, h_t = leaves((9, 20), (9, 20), seed=5)
    t = functional.nclip_terms(h_i, h_t, 0.5, 1.5)
    p_i, p_t = torch.softmax(h_i, 1), torch.softmax(h_t, 1)
    ce = -(p_i * p_t.log()).sum(1).mean() / 2 - (p_t * p_i.log()).sum(1).mean() / 2
    torch.testing.assert_close(t["ce"], ce)
    torch.testing.assert_close(t["kl"], t["ce"] - t["eh"])
    torch.testing.assert_close(t["loss"], t["ce"] + 0.5 * t["eh"] - 1.5 * t["he"])


@pytest.mark.parametrize("w_clip,w_nclip,lam1,lam2", [(0.2, 1.0, 0.5, 1.5), (1.0, 0.3, 0.0, 1.0)])
def test_xclip_is_eq5(w_clip, w_nclip, lam1, lam2):
    g_i, g_t, h_i, h_t = leaves((6, 5), (6, 5), (6, 11), (6, 11), seed=7)
    scale = torch.tensor(14.0, dtype=torch.float64)
    ours = functional.xclip_loss(g_i, g_t, h_i, h_t, scale, w_clip, w_nclip, lam1, lam2)
    ref = w_clip * ref_clip(g_i, g_t, scale) + w_nclip * ref_nclip(h_i, h_t, lam1, lam2)
    torch.testing.assert_close(ours, ref)
    inputs = [g_i, g_t, h_i, h_t]
    for a, r in zip(torch.autograd.grad(ours, inputs), torch.autograd.grad(ref, inputs)):
        torch.testing.assert_close(a, r)


def test_collapsed_input_gives_ln_k_for_every_term():
    k = 4096
    h = torch.zeros(8, k)
    t = functional.nclip_terms(h, h.clone())
    for name in ("ce", "eh", "he"):
        assert t[name].item() == pytest.approx(math.log(k), rel=1e-6)


@pytest.mark.parametrize("magnitude", [1e2, 1e4])
def test_float32_finite_for_extreme_logits(magnitude):
    g = torch.Generator().manual_seed(0)
    for b in (1, 7):
        h_i = (magnitude * torch.randn(b, 64, generator=g)).requires_grad_()
        h_t = (magnitude * torch.randn(b, 64, generator=g)).requires_grad_()
        e_i = (magnitude * torch.randn(b, 16, generator=g)).requires_grad_()
        e_t = (magnitude * torch.randn(b, 16, generator=g)).requires_grad_()
        loss = functional.xclip_loss(e_i, e_t, h_i, h_t, torch.tensor(100.0))
        loss.backward()
        assert torch.isfinite(loss)
        for x in (h_i, h_t, e_i, e_t):
            assert torch.isfinite(x.grad).all()


def test_batch_of_one_has_zero_mean_entropy_gap():
    # With B = 1, p̄ = p so L_EH = L_HE.
    h_i, h_t = leaves((1, 10), (1, 10), seed=3)
    t = functional.nclip_terms(h_i, h_t)
    torch.testing.assert_close(t["eh"], t["he"])


def test_nclip_similarity_is_negative_cross_entropy():
    h_i, h_t = leaves((4, 9), (3, 9), seed=11)
    s = functional.nclip_similarity(h_i, h_t, "image_to_text")
    torch.testing.assert_close(s, ref_nclip_score(h_i, h_t, "image_to_text"))
    assert s.shape == (4, 3)


def test_nclip_similarity_default_is_symmetrised_eq2():
    # issue 15: the paper's zero-shot metric is −L_CE with L_CE symmetrised (Sec. 3.1, Eq. 2)
    h_i, h_t = leaves((40, 12), (6, 12), seed=12, scale=2.0)
    sym = functional.nclip_similarity(h_i, h_t)
    torch.testing.assert_close(sym, ref_nclip_score(h_i, h_t, "symmetric"), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(functional.nclip_similarity(h_i, h_t, "symmetric"), sym)
    one = functional.nclip_similarity(h_i, h_t, "image_to_text")
    assert (sym.argmax(1) != one.argmax(1)).any()  # the two scores pick different classes for some rows
    # float32 in, float32 out; half precision is scored in float32
    s32 = functional.nclip_similarity(h_i.detach().float(), h_t.detach().float())
    assert s32.dtype == torch.float32
    assert functional.nclip_similarity(h_i.detach().bfloat16(), h_t.detach().bfloat16()).dtype == torch.float32
    with pytest.raises(ValueError, match="score must be one of"):
        functional.nclip_similarity(h_i, h_t, "text_to_image")


def test_yclip_similarity_is_s_of_eq2():
    h_i, h_t = leaves((7, 10), (5, 10), seed=13, scale=2.0)
    torch.testing.assert_close(functional.yclip_similarity(h_i, h_t), ref_yclip_score(h_i, h_t),
                               rtol=1e-12, atol=1e-12)


def test_clip_diagnostics():
    e = torch.eye(4, dtype=torch.float64)
    t = functional.clip_terms(e, e, 10.0)
    assert t["acc_i2t"].item() == 1.0 and t["acc_t2i"].item() == 1.0
    assert t["logit_pos"].item() == pytest.approx(10.0)
    assert t["logit_neg"].item() == pytest.approx(0.0)


def test_shape_errors_are_value_errors():
    with pytest.raises(ValueError, match="same shape"):
        functional.clip_terms(torch.randn(3, 4), torch.randn(2, 4), 1.0)["loss"]
    with pytest.raises(ValueError, match="2-D"):
        functional.nclip_terms(torch.randn(3), torch.randn(3))["loss"]
    with pytest.raises(ValueError, match="head widths"):
        functional.nclip_similarity(torch.randn(3, 4), torch.randn(3, 5))
