"""clip_supcon: a SupCon / PaCo / ReCo auxiliary term (OmniBenchmark Eq. 2, 3, 7) on the image side, the
text side or both, beside CLIP or xCLIP (xCLIP paper Eq. 1, 5) -- against float64 transcriptions (values and
gradients), on 2 gloo ranks against 1 process, the heads each choice builds, one-line config errors, and a
micro training run on the digits as tagging data."""

from __future__ import annotations

import json

import pytest
import torch

from batches import row_batch
from nclip.config import resolve
from nclip.errors import NclipError
from nclip.objectives import EncoderOutput, LabelSpace, build_objective, functional
from nclip.objectives.clip_supcon import _TEXT_STREAM, ClipSupconConfig, ClipSupconObjective
from nclip.objectives.supcon import RecoConfig, RecoObjective

from distributed_utils import combine_ranks, loss_and_grads, only_leaves, run_ranks, split_rows
from references import assert_loss_and_grads_close, ref_clip, ref_nclip, ref_paco, ref_reco, ref_supcon

F64 = torch.float64
B, D, DT, K, C, SEED = 8, 5, 4, 6, 3, 5  # batch, supcon dim, CLIP dim, nCLIP prototypes, classes, run seed
ROWS = ("z", "img", "txt", "img_logits", "txt_logits", "labels")
LEAVES = ("z", "img", "txt", "img_logits", "txt_logits", "scale", "centers", "text_centers")


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
    return {"z": r(B, 1, D), "img": r(B, DT), "txt": r(B, DT), "img_logits": 2 * r(B, K), "txt_logits": 2 * r(B, K),
            "centers": r(C, D), "text_centers": r(C, DT), "scale": torch.tensor(7.0, dtype=F64),
            "labels": torch.randint(0, C, (B,), generator=g)}


def _similarity() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    s = torch.rand(C, C, generator=g, dtype=F64)
    return ((s + s.T) / 2).fill_diagonal_(1.0)


SPACE = LabelSpace(("a", "b", "c"), _similarity())


def _keep(labels: torch.Tensor, side: str) -> torch.Tensor:
    """Eq. 5's mask as the module draws it: the side's own stream (seed, no step announced, first forward)
    over the global batch."""
    seed = SEED if side == "image" else SEED + _TEXT_STREAM
    gen = RecoObjective(RecoConfig(), seed=seed, similarity=_similarity()).generator("cpu")
    return functional.reco_keep_mask(labels, _similarity(), gen)


def _aux_ref(cfg: ClipSupconConfig, f: torch.Tensor, labels: torch.Tensor, centers: torch.Tensor, side: str):
    if cfg.aux == "supcon":
        return ref_supcon(f, labels, cfg.temperature)
    paco = (cfg.paco_alpha, cfg.paco_beta, cfg.paco_temperature)
    if cfg.aux == "paco":
        return ref_paco(f, labels, centers, *paco)
    return ref_reco(f, labels, _keep(labels, side), cfg.reco_alpha, cfg.temperature,
                    centers if cfg.reco_base == "paco" else None, paco)


def reference(x: dict, cfg: ClipSupconConfig) -> torch.Tensor:
    """w_CLIP·L_CLIP (+ λ_nCLIP·L_nCLIP, Eq. 5) + w_aux·Σ_sides L_aux, every term a float64 transcription."""
    loss = cfg.clip_weight * ref_clip(x["img"], x["txt"], x["scale"])
    if cfg.contrastive == "xclip":
        loss = loss + cfg.w_nclip * ref_nclip(x["img_logits"], x["txt_logits"], cfg.lambda1, cfg.lambda2)
    if cfg.side in ("image", "both"):
        loss = loss + cfg.w_supcon * _aux_ref(cfg, x["z"], x["labels"], x["centers"], "image")
    if cfg.side in ("text", "both"):
        loss = loss + cfg.w_supcon * _aux_ref(cfg, x["txt"], x["labels"], x["text_centers"], "text")
    return loss


def _out(x: dict) -> EncoderOutput:
    return EncoderOutput(image_features=x["img"], text_features=x["txt"], logit_scale=x["scale"],
                         image={"clip": x["img"], "nclip": x["img_logits"], "supcon": x["z"]},
                         text={"clip": x["txt"], "nclip": x["txt_logits"]})


def _module(cfg: ClipSupconConfig, x: dict) -> ClipSupconObjective:
    obj = ClipSupconObjective(cfg, dim=D, text_dim=DT, seed=SEED, label_space=SPACE).double().train()
    for side, key in (("image", "centers"), ("text", "text_centers")):
        aux = getattr(obj, f"{side}_aux", None)
        if aux is not None and hasattr(aux, "centers"):  # the leaf whose gradient the tests compare
            assert aux.centers.shape == x[key].shape
            del aux.centers
            aux.centers = x[key]
    return obj


CASES = {  # name -> config fields
    "supcon-text": {"side": "text"},
    "supcon-both": {"side": "both", "w_clip": 0.5, "w_supcon": 2.0, "temperature": 0.2},
    "paco-image": {"aux": "paco"},
    "paco-text": {"aux": "paco", "side": "text", "paco_alpha": 1.0},
    "reco-both": {"aux": "reco", "side": "both", "reco_alpha": 0.5},
    "xclip-supcon-image": {"contrastive": "xclip"},
    "xclip-reco-paco-text": {"contrastive": "xclip", "aux": "reco", "reco_base": "paco", "side": "text",
                             "lambda1": 0.3},
    "xclip-paco-both": {"contrastive": "xclip", "aux": "paco", "side": "both", "w_clip": 1.0, "w_nclip": 0.5},
}


def _loss(case: str):
    cfg = ClipSupconConfig(**CASES[case])

    def loss(x: dict) -> torch.Tensor:
        return _module(cfg, x)(_out(x), row_batch(x["labels"]))["loss"]

    return loss


def _split(x: dict, rank: int, world: int) -> dict:
    return split_rows(x, ROWS, rank, world, leaves=LEAVES)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64_reference(case):
    cfg = ClipSupconConfig(**CASES[case])
    a, b = _split(_inputs(3), 0, 1), _split(_inputs(3), 0, 1)
    ga = dict(zip(LEAVES, assert_loss_and_grads_close(_loss(case)(a), reference(b, cfg), a, b, LEAVES, case)))
    # every input the choice reads gets a gradient, and none that it does not read
    assert (ga["img_logits"] is not None) == (cfg.contrastive == "xclip")
    assert (ga["z"] is not None) == (cfg.side != "text")
    assert (ga["centers"] is not None) == (cfg.uses_paco and cfg.side != "text")
    assert (ga["text_centers"] is not None) == (cfg.uses_paco and cfg.side != "image")


def test_text_side_is_the_label_aware_term_on_the_captions():
    """With w_clip = 0 the loss is SupCon over the text embeddings alone: captions of one class (any template)
    are each other's positives, so it falls when same-class captions align, whatever the images do."""
    x = _inputs(4)
    obj = _module(ClipSupconConfig(side="text", w_clip=0.0), x)
    labels = x["labels"]
    aligned = dict(x, txt=torch.nn.functional.one_hot(labels, DT).to(F64) + 0.01 * x["txt"])
    batch = row_batch(labels)
    assert obj(_out(aligned), batch)["supcon_text/loss"] < obj(_out(x), batch)["supcon_text/loss"]
    terms = obj(_out(x), row_batch(labels))
    assert "supcon/loss" not in terms and terms["loss"] == terms["supcon_text/loss"]


def test_reco_sides_draw_independent_masks_keyed_by_the_announced_step():
    x = _inputs(5)
    cfg = ClipSupconConfig(aux="reco", side="both")
    assert not torch.equal(_keep(x["labels"], "image"), _keep(x["labels"], "text"))
    a, b, fresh = _module(cfg, x), _module(cfg, x), _module(cfg, x)
    a.before_step(7, 10)  # reaches both sides' draws: a module told the same step draws the same masks
    b.before_step(7, 10)
    side_terms = ("reco/reco", "reco_text/reco")
    got, same, other = (m(_out(x), row_batch(x["labels"])) for m in (a, b, fresh))
    assert all(got[k] == same[k] for k in side_terms)
    assert all(got[k] != other[k] for k in side_terms)  # step 7's draws, not those of no step
    assert not any(k.endswith("draws") for k in a.state_dict())  # host data: nothing on the device to restore


@pytest.mark.parametrize("fields,heads", [
    ({}, {"clip", "supcon"}),
    ({"side": "text"}, {"clip"}),
    ({"side": "both", "contrastive": "xclip"}, {"clip", "nclip", "supcon"}),
])
def test_the_model_builds_the_heads_of_the_choice(fields, heads):
    from nclip.models.dual_encoder import build_model

    sets = [f"objective.{k}={v}" for k, v in fields.items()]
    cfg = resolve("supcon-tiny", ["objective.name=clip_supcon", "model.supcon_hidden=16", "model.supcon_dim=8",
                                  "model.embed_dim=16", "model.nclip_hidden=16", "model.nclip_dim=8", *sets])
    model = build_model(cfg, pretrained_text=False)
    assert set(model.heads) == heads
    objective = build_objective(cfg.objective, cfg, label_space=SPACE)
    watch = type(objective).collapse_watch(cfg.objective)
    assert (watch is not None and watch.prefix == "nclip") == (cfg.objective.contrastive == "xclip")


@pytest.mark.parametrize("extra,match", [
    (["objective.hierarchy=tree.json"], "objective: hierarchy is only read with aux reco"),
    (["objective.lambda1=0.3"], "lambda1 is only read with contrastive xclip"),
    (["objective.aux=supcon", "objective.paco_beta=2"], "paco_beta is only read with aux paco"),
    (["objective.aux=paco", "objective.temperature=0.3"], "temperature is only read with aux supcon or reco"),
    (["objective.side=both", "objective.queue_size=16"], "queue holds image-side projections only"),
    (["objective.side=left"], "objective.side"),
    (["objective.aux=reco", "objective.hierarchy=/nonexistent/tree.json"], "is not a file"),
])
def test_bad_config_is_one_line(extra, match):
    with pytest.raises(NclipError, match=match) as e:
        resolve("supcon-tiny", ["objective.name=clip_supcon", *extra])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("fields", [{}, {"aux": "paco", "side": "text"}, {"contrastive": "xclip", "aux": "reco"}])
def test_a_runs_written_config_reads_back(tmp_path, fields):
    """config.yaml lists every field at its value: the settings-in-use check must accept its defaults."""
    from nclip.config import to_yaml

    cfg = resolve("supcon-tiny", ["objective.name=clip_supcon", *(f"objective.{k}={v}" for k, v in fields.items())])
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    assert resolve(str(tmp_path / "config.yaml")).objective == cfg.objective


def test_reco_asks_for_the_hierarchy_and_paco_for_the_classes():
    from nclip.data.labels import label_space_for

    cfg = resolve("supcon-tiny", ["objective.name=clip_supcon", "objective.aux=reco", "objective.side=text"])
    space = label_space_for(cfg)
    assert space.num_classes == 10 and space.similarity.shape == (10, 10)
    assert label_space_for(resolve("supcon-tiny", ["objective.name=clip_supcon"])).similarity is None
    cfg = resolve("supcon-tiny", ["objective.name=clip_supcon", "objective.aux=paco", "objective.side=both",
                                  "model.supcon_dim=8", "model.embed_dim=16"])
    obj = build_objective(cfg.objective, cfg, label_space=label_space_for(cfg))
    assert obj.image_aux.centers.shape == (10, 8) and obj.text_aux.centers.shape == (10, 16)


# ---- 2 ranks against 1 process --------------------------------------------------------------------


def _rank(rank: int, world: int) -> dict:
    return {case: loss_and_grads(_loss(case), _split(_inputs(6), rank, world)) for case in CASES}


@pytest.mark.slow
def test_two_ranks_match_one_process():
    results = run_ranks(_rank, 2)
    for case in CASES:
        ref_loss, ref_grads = only_leaves(loss_and_grads(_loss(case), _split(_inputs(6), 0, 1)), LEAVES)
        loss, grads = combine_ranks([only_leaves(r[case], LEAVES) for r in results], ROWS[:-1])
        torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12, msg=case)
        for k in ref_grads:
            torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-9, atol=1e-12, msg=f"{case}: d/d{k}")


# ---- training on tagging data ---------------------------------------------------------------------


@pytest.mark.slow
def test_trains_beside_xclip_on_digits_tagging_data(tmp_path):
    """ReCo beside xCLIP on both sides of the digits as tagging data (captions: templates of the class
    names), micro sizes: every term is logged and finite, and the zero-shot eval runs on the CLIP head."""
    from nclip.cli import main

    from conftest import micro_sizes

    sets = [*micro_sizes(), "data.source=digits", "data.tagging.enabled=true", "train.batch_size=32",
            "train.steps=4", "train.log_every=1", "train.checkpoint_every=4", "train.threads=1",
            "eval.samples=32", "model.supcon_hidden=16", "model.supcon_dim=8", "objective.name=clip_supcon",
            "objective.contrastive=xclip", "objective.aux=reco", "objective.side=both"]
    out = tmp_path / "run"
    assert main(["train", "--preset", "micro", "--out", str(out), "--no-progress"]
                + [a for s in sets for a in ("--set", s)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for key in ("loss", "clip/loss", "nclip/L_CE", "reco/loss", "reco/kept", "reco_text/loss", "reco_text/kept"):
        assert all(torch.isfinite(torch.tensor(r[key])) for r in rows), key
    assert any(r["reco_text/reco"] > 0 for r in rows)
    result = json.loads((out / "eval.json").read_text())
    assert 0.0 <= result["zeroshot/digit/top1"] <= 1.0
