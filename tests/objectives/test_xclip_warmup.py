"""xCLIP's Tab. 9f "warm-up on L_nCLIP": λ_nCLIP = 0 until a start step, then a linear ramp to its base
scale, as a pure function of the optimizer step."""

import pytest
import torch

from nclip.objectives import build_objective
from nclip.objectives.nclip import XclipConfig, nclip_weight_at

from references import encoder_output, leaves, ref_clip, ref_nclip


@pytest.mark.parametrize("start,ramp,expected", [
    (10, 4, {0: 0.0, 9: 0.0, 10: 0.0, 11: 0.25, 12: 0.5, 13: 0.75, 14: 1.0, 1000: 1.0}),
    (10, 0, {0: 0.0, 9: 0.0, 10: 1.0, 11: 1.0}),
    (0, 5, {0: 0.0, 1: 0.2, 5: 1.0, 6: 1.0}),
    (0, 0, {0: 1.0, 7: 1.0}),
])
def test_weight_at_given_steps(start, ramp, expected):
    for step, frac in expected.items():
        assert nclip_weight_at(step, 0.8, start, ramp) == pytest.approx(0.8 * frac), step
    assert nclip_weight_at(None, 0.8, start, ramp) == 0.8  # no trainer step (evaluation): the base scale


def test_xclip_weighs_the_ncliploss_by_the_announced_step():
    g_i, g_t, h_i, h_t = leaves((6, 5), (6, 5), (6, 11), (6, 11), seed=7)
    out = encoder_output(h_i, h_t, g_i, g_t)
    cfg = XclipConfig(w_clip=0.2, w_nclip=1.0, nclip_warmup_start=2, nclip_warmup_steps=4)
    clip, nclip = ref_clip(g_i, g_t, out.logit_scale), ref_nclip(h_i, h_t, 0.5, 1.5)
    objective = build_objective(cfg)
    for step, w in [(0, 0.0), (2, 0.0), (3, 0.25), (5, 0.75), (6, 1.0), (9, 1.0)]:
        objective.before_step(step, 10)
        terms = objective(out)
        torch.testing.assert_close(terms["loss"], 0.2 * clip + w * nclip)
        assert terms["nclip/lambda"].item() == w
    # resume: a fresh objective told step 3 gives step 3's loss (nothing carried between steps)
    fresh = build_objective(cfg)
    fresh.before_step(3, 10)
    torch.testing.assert_close(fresh(out)["loss"], 0.2 * clip + 0.25 * nclip)
    # a zero weight still reaches the nCLIP head (zero gradient, not none: DDP sees every parameter)
    fresh.before_step(0, 10)
    grad = torch.autograd.grad(fresh(out)["loss"], h_i)[0]
    assert torch.equal(grad, torch.zeros_like(grad))
    # without a warm-up nothing changes: Eq. 5, and no extra logged term
    plain = build_objective(XclipConfig(w_clip=0.2, w_nclip=1.0))
    plain.before_step(0, 10)
    terms = plain(out)
    torch.testing.assert_close(terms["loss"], 0.2 * clip + nclip)
    assert "nclip/lambda" not in terms
