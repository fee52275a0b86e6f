"""Every registered objective, as the trainer runs it (its module on an EncoderOutput), against a
float64 transcription of its paper's equations (values and gradients), and on 2 gloo ranks
against 1 process with the same global batch.

Registering an objective without a case here makes these tests fail, not skip: add its reference
to REFERENCES (and, if its module needs inputs beyond an EncoderOutput, say so in COVERED_ELSEWHERE
with the tests that check it).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from nclip.objectives import REGISTRY, EncoderOutput, functional

from distributed_utils import combine_ranks, loss_and_grads, run_ranks, split_rows
from references import (
    assert_loss_and_grads_close,
    ref_clip,
    ref_clip_algorithm1,
    ref_nclip,
    ref_siglip,
    ref_unified,
    ref_yclip,
)

B, DIM, K = 8, 6, 5
ROW_KEYS = ("img", "txt", "img_logits", "txt_logits")

# name -> reference(inputs, cfg): the loss of the objective's default config, from the papers
REFERENCES = {
    "clip": lambda x, c: ref_clip(x["img"], x["txt"], x["scale"]),
    "nclip": lambda x, c: ref_nclip(x["img_logits"], x["txt_logits"], c.lambda1, c.lambda2),
    "xclip": lambda x, c: (c.w_clip * ref_clip(x["img"], x["txt"], x["scale"])
                           + c.w_nclip * ref_nclip(x["img_logits"], x["txt_logits"], c.lambda1, c.lambda2)),
    "unified": lambda x, c: ref_unified(x["img_logits"], x["txt_logits"], c.tau_s, c.tau, c.lambda1, c.lambda2,
                                        c.uniform),
    "yclip": lambda x, c: ref_yclip(x["img_logits"], x["txt_logits"], x["scale"], c.lambda1, c.lambda2),
    "siglip": lambda x, c: ref_siglip(x["img"], x["txt"], x["scale"], c.bias_init),
    "xsiglip": lambda x, c: (c.w_clip * ref_siglip(x["img"], x["txt"], x["scale"], c.bias_init)
                             + c.w_nclip * ref_nclip(x["img_logits"], x["txt_logits"], c.lambda1, c.lambda2)),
}

# the objectives with CLIP's InfoNCE term (functional.clip_terms), i.e. objective.clip_reduction
# (issue 27.2); SigLIP's loss is one sum over all B·B pairs, with no two directions to reduce, and
# yCLIP's InfoNCE is over its own score S (Appendix B.2), not CLIP's head
WITH_CLIP_TERM = {"clip", "xclip", "protoclip", "clip_cmsf", "clip_supcon"}
# Algorithm 1's L_CLIP (the sum of both directions): the objectives covered here; protoclip, clip_cmsf
# and clip_supcon check clip_reduction sum in their own files (test_protoclip, test_cmsf_train, test_supcon)
SUM_REFERENCES = {
    "clip": lambda x, c: ref_clip_algorithm1(x["img"], x["txt"], x["scale"]),
    "xclip": lambda x, c: (c.w_clip * ref_clip_algorithm1(x["img"], x["txt"], x["scale"])
                           + c.w_nclip * ref_nclip(x["img_logits"], x["txt_logits"], c.lambda1, c.lambda2)),
}

# episodic objectives need an episode's prototypes: their float64 and 2-rank checks live beside them
COVERED_ELSEWHERE = {
    "protoclip": ("test_protoclip", ["test_proto_loss_matches_algorithm1", "test_two_ranks_match_one_process"]),
}
# CMSF's modules need two views' outputs, labels and a memory bank; xent needs labels: their float64
# (against references.ref_cmsf) and 2-rank checks live in test_cmsf_train
COVERED_ELSEWHERE.update({name: ("test_cmsf_train", ["test_objective_matches_float64_reference",
                                                     "test_two_ranks_match_one_process"])
                          for name in ("cmsf", "clip_cmsf", "xent")})
# CMSF's baselines (Sec. 2.1.1) need labels, and ProtoNW two views' outputs and a memory bank: their float64
# (against references.ref_protonw, ref_frzproto) and 2-rank checks live in test_cmsf_baselines
COVERED_ELSEWHERE.update({name: ("test_cmsf_baselines", ["test_objective_matches_float64_reference",
                                                         "test_two_ranks_match_one_process"])
                          for name in ("protonw", "frzproto")})
# the SupCon family needs the "supcon" head's multi-view projections and labels (PaCo its centres, ReCo a
# class similarity and its seeded draws): float64 (against references.ref_supcon, ref_paco, ref_reco) and
# 2-rank checks live in test_supcon
COVERED_ELSEWHERE.update({name: ("test_supcon", ["test_objective_matches_float64_reference",
                                                 "test_two_ranks_match_one_process"])
                          for name in ("supcon", "paco", "reco", "clip_supcon")})


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return {"img": r(B, DIM), "txt": r(B, DIM), "img_logits": 2 * r(B, K), "txt_logits": 2 * r(B, K),
            "scale": torch.tensor(7.0, dtype=torch.float64)}


def _module_loss(name: str, **cfg):
    """The registered module with its default config (``cfg`` overrides), as a loss of the inputs."""
    config_cls, objective_cls = REGISTRY[name]

    def loss(x: dict[str, torch.Tensor]) -> torch.Tensor:
        objective = objective_cls(config_cls(**cfg)).double()
        out = EncoderOutput(image_features=x["img"], text_features=x["txt"], logit_scale=x["scale"],
                            image={"clip": x["img"], "nclip": x["img_logits"]},
                            text={"clip": x["txt"], "nclip": x["txt_logits"]})
        return objective(out)["loss"]

    return loss


def _covered_here() -> list[str]:
    return [name for name in REGISTRY if name not in COVERED_ELSEWHERE]


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_registered_objective_has_a_float64_reference(name):
    if name in COVERED_ELSEWHERE:
        module_name, tests = COVERED_ELSEWHERE[name]
        module = importlib.import_module(module_name)
        assert all(callable(getattr(module, t, None)) for t in tests), (name, module_name, tests)
        return
    assert name in REFERENCES, f"objective {name!r} is registered but has no float64 reference in this file"
    config = REGISTRY[name][0]()
    inputs, ref_inputs = ({k: v.clone().requires_grad_() for k, v in _inputs().items()} for _ in range(2))
    assert_loss_and_grads_close(_module_loss(name)(inputs), REFERENCES[name](ref_inputs, config), inputs, ref_inputs,
                                list(inputs), name)


def test_clip_reduction_is_on_every_objective_with_a_clip_term():
    assert {name for name, (config, _) in REGISTRY.items() if "clip_reduction" in config.model_fields} == WITH_CLIP_TERM
    assert set(SUM_REFERENCES) == WITH_CLIP_TERM & set(_covered_here())
    for name in WITH_CLIP_TERM:
        field = REGISTRY[name][0].model_fields["clip_reduction"]
        assert field.default == "mean" and set(field.annotation.__args__) == set(functional.CLIP_REDUCTIONS)


@pytest.mark.parametrize("name", sorted(SUM_REFERENCES))
def test_clip_reduction_sum_matches_algorithm1(name):
    config = REGISTRY[name][0](clip_reduction="sum")
    inputs, ref_inputs = ({k: v.clone().requires_grad_() for k, v in _inputs().items()} for _ in range(2))
    ours = _module_loss(name, clip_reduction="sum")(inputs)
    assert_loss_and_grads_close(ours, SUM_REFERENCES[name](ref_inputs, config), inputs, ref_inputs, list(inputs), name)


def test_clip_reduction_sum_logs_the_term_as_it_enters_eq5():
    x = _inputs()
    out = EncoderOutput(image_features=x["img"], text_features=x["txt"], logit_scale=x["scale"],
                        image={"clip": x["img"], "nclip": x["img_logits"]},
                        text={"clip": x["txt"], "nclip": x["txt_logits"]})
    config_cls, objective_cls = REGISTRY["xclip"]
    mean, summed = (objective_cls(config_cls(clip_reduction=r)).double()(out) for r in ("mean", "sum"))
    torch.testing.assert_close(summed["clip/loss"], 2 * mean["clip/loss"])
    torch.testing.assert_close(summed["clip/loss"], ref_clip_algorithm1(x["img"], x["txt"], x["scale"]))
    torch.testing.assert_close(summed["loss"] - mean["loss"], 0.2 * mean["clip/loss"])  # λ_CLIP·(sum − mean)
    torch.testing.assert_close(summed["clip/acc_i2t"], mean["clip/acc_i2t"])
    with pytest.raises(ValueError, match="clip reduction 'max'"):
        functional.clip_terms(x["img"], x["txt"], x["scale"], reduction="max")["loss"]


def _rank(rank: int, world: int) -> dict:
    out = {name: loss_and_grads(_module_loss(name), split_rows(_inputs(), ROW_KEYS, rank, world))
           for name in _covered_here()}
    out.update({f"{name}:sum": loss_and_grads(_module_loss(name, clip_reduction="sum"),
                                              split_rows(_inputs(), ROW_KEYS, rank, world))
                for name in SUM_REFERENCES})
    return out


@pytest.fixture(scope="module")
def two_rank_results():
    return run_ranks(_rank, 2)


@pytest.mark.slow
@pytest.mark.parametrize("name", _covered_here() + [f"{name}:sum" for name in sorted(SUM_REFERENCES)])
def test_every_registered_objective_matches_single_process_on_two_ranks(two_rank_results, name):
    base, _, reduction = name.partition(":")
    cfg = {"clip_reduction": reduction} if reduction else {}
    ref_loss, ref_grads = loss_and_grads(_module_loss(base, **cfg), split_rows(_inputs(), ROW_KEYS, 0, 1))
    loss, grads = combine_ranks([r[name] for r in two_rank_results], ROW_KEYS)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-9, atol=1e-12, msg=f"{name}: d/d{k}")
    assert any(g.abs().sum() > 0 for g in ref_grads.values())
