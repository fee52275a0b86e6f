"""SupCon, PaCo and ReCo (OmniBenchmark paper Eq. 2-7): the pure functions and the trainer modules against
float64 loop-style transcriptions (values, gradients), their edge cases (an anchor without a positive, a
batch of one class, a single image), ReCo's Bernoulli selection (keep rate 1 - s, s = 0 identity,
determinism), the model's "supcon" head, the label space the trainer hands in, one-line config errors,
and 2 gloo ranks against 1 process."""

from __future__ import annotations

import json

import pytest
import torch

from batches import row_batch
from nclip.config import resolve
from nclip.errors import NclipError
from nclip.objectives import REGISTRY, EncoderOutput, LabelSpace, build_objective, functional
from nclip.objectives.clip_supcon import ClipSupconConfig, ClipSupconObjective
from nclip.objectives.supcon import (
    PacoConfig,
    PacoObjective,
    RecoConfig,
    RecoObjective,
    SupconConfig,
    SupconObjective,
)
from nclip.train.logbook import WALL_CLOCK

from distributed_utils import combine_ranks, loss_and_grads, only_leaves, run_ranks, split_rows
from references import assert_loss_and_grads_close, ref_clip, ref_clip_algorithm1, ref_paco, ref_reco, ref_supcon

F64 = torch.float64
B, V, D, C, Q = 8, 2, 5, 3, 6


def _inputs(seed: int = 0, b: int = B, v: int = V, classes: int = C) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
    return {"z": r(b, v, D), "centers": r(classes, D), "queue": r(Q, D), "img": r(b, D), "txt": r(b, D),
            "scale": torch.tensor(7.0, dtype=F64),
            "labels": torch.randint(0, classes, (b,), generator=g),
            "queue_labels": torch.randint(0, classes, (Q,), generator=g)}


def _similarity(seed: int = 0, classes: int = C) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    s = torch.rand(classes, classes, generator=g, dtype=F64)
    s = (s + s.T) / 2
    return s.fill_diagonal_(1.0)


def _keep(labels: torch.Tensor, views: int, seed: int = 3, cols: torch.Tensor | None = None) -> torch.Tensor:
    rows = labels.repeat_interleave(views)
    return functional.reco_keep_mask(rows, _similarity(), torch.Generator().manual_seed(seed),
                                     candidate_labels=rows if cols is None else torch.cat([rows, cols]))


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(True)


def _check(ours_fn, ref_fn, names: tuple[str, ...], x: dict) -> None:
    a = {k: _leaf(x[k]) for k in names}
    b = {k: _leaf(x[k]) for k in names}
    ga = assert_loss_and_grads_close(ours_fn(a), ref_fn(b), a, b, names)
    assert ga[0] is not None and ga[0].abs().sum() > 0


# ---- the pure functions against the transcriptions ------------------------------------------------


@pytest.mark.parametrize("seed,v,tau,unlabelled", [(0, 2, 0.1, False), (1, 1, 0.1, False), (2, 2, 0.5, True),
                                                   (3, 3, 0.07, False), (4, 1, 1.0, True)])
def test_supcon_matches_eq2(seed, v, tau, unlabelled):
    x = _inputs(seed, v=v)
    if unlabelled:
        x["labels"][::3] = functional.UNLABELLED
    _check(lambda a: functional.supcon_terms(a["z"], x["labels"], temperature=tau)["loss"],
           lambda a: ref_supcon(a["z"], x["labels"], tau), ("z",), x)


def test_supcon_with_a_queue_and_a_keep_mask():
    x = _inputs(5)
    keep = _keep(x["labels"], V, cols=x["queue_labels"])
    assert not keep.all() and keep.shape == (B * V, B * V + Q)
    kw = {"queue": x["queue"], "queue_labels": x["queue_labels"]}
    _check(lambda a: functional.supcon_terms(a["z"], x["labels"], keep=keep, **kw)["loss"],
           lambda a: ref_supcon(a["z"], x["labels"], 0.1, keep, **kw), ("z",), x)
    flat = x["z"].reshape(-1, D)  # [N, D] features: V = 1 over the same rows
    torch.testing.assert_close(functional.supcon_terms(x["z"][:, :1], x["labels"])["loss"],
                               functional.supcon_terms(flat[::V], x["labels"])["loss"])


@pytest.mark.parametrize("alpha,beta,tau,queue", [(0.05, 1.0, 0.2, False), (1.0, 1.0, 0.1, True),
                                                  (0.3, 0.0, 0.2, False), (0.0, 2.0, 0.5, True)])
def test_paco_matches_eq3(alpha, beta, tau, queue):
    x = _inputs(6)
    kw = {"queue": x["queue"], "queue_labels": x["queue_labels"]} if queue else {}
    _check(lambda a: functional.paco_terms(a["z"], x["labels"], a["centers"], alpha=alpha, beta=beta,
                                          temperature=tau, **kw)["loss"],
           lambda a: ref_paco(a["z"], x["labels"], a["centers"], alpha, beta, tau, **kw), ("z", "centers"), x)


@pytest.mark.parametrize("base", ["supcon", "paco"])
def test_reco_matches_eq7(base):
    x = _inputs(7)
    keep = _keep(x["labels"], V)
    paco = base == "paco"
    _check(lambda a: functional.reco_terms(a["z"], x["labels"], keep, alpha=0.7,
                                          centers=a["centers"] if paco else None)["loss"],
           lambda a: ref_reco(a["z"], x["labels"], keep, 0.7, 0.1, a["centers"] if paco else None),
           ("z", "centers"), x)


def test_an_anchor_without_a_positive_contributes_nothing():
    x = _inputs(8, v=1)
    labels = torch.tensor([0, 0, 1, 1, 2, 2, 2, 5])  # the last image is alone in its class
    z = _leaf(x["z"])
    terms = functional.supcon_terms(z, labels)
    assert terms["anchors_with_positives"] == pytest.approx(7 / 8)
    # the lone anchor is still a negative of the others
    others = functional.supcon_terms(x["z"][:7], labels[:7])["loss"]
    assert not torch.isclose(terms["loss"], others)
    torch.testing.assert_close(terms["loss"], ref_supcon(x["z"], labels))
    terms["loss"].backward()
    assert torch.isfinite(z.grad).all()
    nobody = functional.supcon_terms(_leaf(x["z"]), torch.arange(B))  # every class alone: no anchor counts
    assert nobody["loss"] == 0 and nobody["anchors_with_positives"] == 0


def test_a_batch_of_one_class_and_a_single_image():
    x = _inputs(9)
    same = torch.zeros(B, dtype=torch.long)
    _check(lambda a: functional.supcon_terms(a["z"], same)["loss"], lambda a: ref_supcon(a["z"], same), ("z",), x)
    terms = functional.supcon_terms(x["z"], same)
    assert terms["negatives"] == 0 and terms["positives"] == B * V - 1
    one = _leaf(x["z"][:1, :1])  # one image, one view: nothing to contrast
    loss = functional.supcon_terms(one, same[:1])["loss"]
    loss.backward()
    assert loss == 0 and torch.isfinite(one.grad).all()
    two = _leaf(x["z"][:1])  # one image, two views: each view is the other's only candidate, log 1 = 0
    assert functional.supcon_terms(two, same[:1])["loss"].abs() < 1e-12
    paco = functional.paco_terms(_leaf(x["z"][:1, :1]), same[:1], x["centers"])["loss"]  # the centres still contrast
    assert torch.isfinite(paco) and paco > 0


def test_extreme_logits_stay_finite_in_float32():
    x = _inputs(10)
    z = _leaf(x["z"].float())
    loss = functional.supcon_terms(z, x["labels"], temperature=1e-4)["loss"]
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(z.grad).all()


# ---- ReCo's negative selection (Eq. 5) ------------------------------------------------------------


def test_reco_keeps_negatives_with_probability_one_minus_s():
    s = torch.tensor([[1.0, 0.25, 0.9], [0.25, 1.0, 0.0], [0.9, 0.0, 1.0]])
    labels = torch.arange(3).repeat(200)  # [600]
    keep = functional.reco_keep_mask(labels, s, torch.Generator().manual_seed(0))
    for m in range(3):
        for n in range(3):
            rate = keep[labels == m][:, labels == n].float().mean()
            expected = 1.0 if m == n else 1 - float(s[m, n])  # same class: a positive, always kept
            assert abs(rate - expected) < 0.01, (m, n, rate)
    again = functional.reco_keep_mask(labels, s, torch.Generator().manual_seed(0))
    assert torch.equal(keep, again)
    unlabelled = labels.clone()
    unlabelled[:10] = functional.UNLABELLED
    mask = functional.reco_keep_mask(unlabelled, s, torch.Generator().manual_seed(1))
    assert mask[:10].all() and mask[:, :10].all()


def test_s_zero_makes_reco_the_supcon_loss_again():
    x = _inputs(11)
    rows = x["labels"].repeat_interleave(V)
    keep = functional.reco_keep_mask(rows, torch.zeros(C, C), torch.Generator().manual_seed(0))
    assert keep.all()
    terms = functional.reco_terms(x["z"], x["labels"], keep, alpha=0.4)
    supcon = functional.supcon_terms(x["z"], x["labels"])["loss"]
    torch.testing.assert_close(terms["loss"], 1.4 * supcon, rtol=1e-12, atol=0)  # L = (1 + α)·L_SupCon
    assert terms["kept"] == 1.0
    ones = functional.reco_keep_mask(rows, torch.ones(C, C), torch.Generator().manual_seed(0))
    assert torch.equal(ones, rows[:, None] == rows[None])  # s = 1: only the positives stay


def test_bad_arguments_are_value_errors():
    x = _inputs(12)
    with pytest.raises(ValueError, match="labels must be"):
        functional.supcon_terms(x["z"], x["labels"][:3])["loss"]
    with pytest.raises(ValueError, match="keep must be bool"):
        functional.supcon_terms(x["z"], x["labels"], keep=torch.ones(3, 3, dtype=torch.bool))["loss"]
    with pytest.raises(ValueError, match="labels must be < K"):
        functional.paco_terms(x["z"], x["labels"] + C, x["centers"])["loss"]
    with pytest.raises(ValueError, match="similarity must be"):
        functional.reco_keep_mask(x["labels"], torch.ones(3, 2), torch.Generator())


# ---- the trainer modules --------------------------------------------------------------------------


def _out(x: dict) -> EncoderOutput:
    return EncoderOutput(image_features=x["img"], text_features=x["txt"], logit_scale=x["scale"],
                         image={"clip": x["img"], "supcon": x["z"]}, text={"clip": x["txt"]})


def _module(name: str, x: dict, **cfg):
    """The module in float64: PaCo's centres are x's, ReCo's similarity is _similarity()."""
    if name == "supcon":
        obj = SupconObjective(SupconConfig(**cfg), dim=D)
    elif name == "clip_supcon":
        obj = ClipSupconObjective(ClipSupconConfig(**cfg), dim=D)
    elif name == "paco":
        obj = PacoObjective(PacoConfig(**cfg), dim=D, num_classes=C)
    else:
        obj = RecoObjective(RecoConfig(**cfg), dim=D, seed=5, similarity=_similarity(), num_classes=C)
    obj = obj.double().train()
    if hasattr(obj, "centers"):  # the leaf whose gradient the tests compare, in place of the parameter
        del obj.centers
        obj.centers = x["centers"]
    return obj


def _reco_keep(x: dict, seed: int = 5) -> torch.Tensor:
    rows = x["labels"].repeat_interleave(x["z"].shape[1])
    return functional.reco_keep_mask(rows, _similarity(), RecoObjective(RecoConfig(), seed=seed,
                                                                       similarity=_similarity()).generator("cpu"))


MODULES = {  # case -> (name, config, reference)
    "supcon": ("supcon", {}, lambda x: ref_supcon(x["z"], x["labels"])),
    "supcon-tau": ("supcon", {"temperature": 0.3}, lambda x: ref_supcon(x["z"], x["labels"], 0.3)),
    "paco": ("paco", {}, lambda x: ref_paco(x["z"], x["labels"], x["centers"], 0.05, 1.0, 0.2)),
    "paco-eq3": ("paco", {"alpha": 1.0, "beta": 1.0, "temperature": 0.1},
                 lambda x: ref_paco(x["z"], x["labels"], x["centers"], 1.0, 1.0, 0.1)),
    "reco": ("reco", {}, lambda x: ref_reco(x["z"], x["labels"], _reco_keep(x))),
    "reco-paco": ("reco", {"base": "paco", "reco_alpha": 0.5},
                  lambda x: ref_reco(x["z"], x["labels"], _reco_keep(x), 0.5, 0.1, x["centers"])),
    "clip_supcon": ("clip_supcon", {"w_clip": 0.7, "w_supcon": 1.3},
                    lambda x: 0.7 * ref_clip(x["img"], x["txt"], x["scale"])
                    + 1.3 * ref_supcon(x["z"][:, :1], x["labels"])),
    # issue 27.2: L_CLIP as Algorithm 1 writes it, the sum of both InfoNCE directions
    "clip_supcon-sum": ("clip_supcon", {"w_clip": 0.7, "w_supcon": 1.3, "clip_reduction": "sum"},
                        lambda x: 0.7 * ref_clip_algorithm1(x["img"], x["txt"], x["scale"])
                        + 1.3 * ref_supcon(x["z"][:, :1], x["labels"])),
}
LEAVES = ("z", "centers", "img", "txt", "scale")
ROWS = ("z", "img", "txt", "labels")


def _module_loss(case: str):
    name, cfg, _ = MODULES[case]

    def loss(x: dict) -> torch.Tensor:
        x = dict(x)
        if name == "clip_supcon":
            x["z"] = x["z"][:, :1]  # one view beside CLIP
        obj = _module(name, x, **cfg)
        return obj(_out(x), row_batch(x["labels"]))["loss"]

    return loss


def _split(x: dict, rank: int, world: int) -> dict:
    return split_rows(x, ROWS, rank, world, leaves=LEAVES)


@pytest.mark.parametrize("case", list(MODULES))
def test_objective_matches_float64_reference(case):
    _, _, ref = MODULES[case]
    a, b = _split(_inputs(13), 0, 1), _split(_inputs(13), 0, 1)
    ga = assert_loss_and_grads_close(_module_loss(case)(a), ref(b), a, b, LEAVES, case)
    if "paco" in case:  # the centres are learnt
        assert ga[1] is not None and ga[1].abs().sum() > 0


def test_reco_draws_are_keyed_by_step_and_forward():
    """The key of a forward's draws is (seed, announced step, training forward within the step): host
    data, so no device read, nothing to checkpoint, and a resumed module draws what the uninterrupted one drew."""
    x = _inputs(14)
    a, b = _module("reco", x), _module("reco", x)
    first = [a(_out(x), row_batch(x["labels"]))["loss"] for _ in range(3)]
    second = [b(_out(x), row_batch(x["labels"]))["loss"] for _ in range(3)]
    assert first == second and len({float(v) for v in first}) == 3  # a new draw each training forward
    assert "draws" not in a.state_dict() and "similarity" not in a.state_dict()
    a.eval()
    a(_out(x), row_batch(x["labels"]))  # evaluation draws from the current key without advancing it
    a.train()
    assert a(_out(x), row_batch(x["labels"]))["loss"] == b(_out(x), row_batch(x["labels"]))["loss"]
    a.before_step(5, 10)
    resumed = _module("reco", x)
    state = a.state_dict()
    resumed.load_state_dict(state)
    resumed.before_step(5, 10)
    step5 = [a(_out(x), row_batch(x["labels"]))["loss"] for _ in range(2)]
    assert step5 == [resumed(_out(x), row_batch(x["labels"]))["loss"] for _ in range(2)]  # resume draws the same stream
    a.before_step(6, 10)
    resumed.before_step(5, 10)
    batch = row_batch(x["labels"])
    assert a(_out(x), batch)["loss"] != resumed(_out(x), batch)["loss"]  # another step, another draw


def test_queue_enqueues_every_view_and_is_a_candidate():
    x = _inputs(15)
    obj = SupconObjective(SupconConfig(queue_size=40), dim=D).double().train()
    first = obj(_out(x), row_batch(x["labels"]))
    assert first["supcon/queue_fill"] == pytest.approx(B * V / 40)
    view = obj.queue.view()
    torch.testing.assert_close(view.embeddings, torch.nn.functional.normalize(x["z"].reshape(-1, D), dim=-1))
    assert torch.equal(view.labels, x["labels"].repeat_interleave(V))
    second = obj(_out(x), row_batch(x["labels"]))
    torch.testing.assert_close(second["loss"], ref_supcon(x["z"], x["labels"], 0.1, None, view.embeddings,
                                                          view.labels))


def test_paco_centres_are_optimised(tmp_path):
    from nclip.models.dual_encoder import build_model
    from nclip.train.optim import build_optimizer

    cfg = resolve("supcon-tiny", ["objective.name=paco", "model.supcon_hidden=16", "model.supcon_dim=8"])
    objective = build_objective(cfg.objective, cfg, label_space=LabelSpace(tuple("abcdefghij")))
    assert objective.centers.shape == (10, 8)
    optimizer = build_optimizer([build_model(cfg, pretrained_text=False), objective], cfg.train)
    assert any(p is objective.centers for g in optimizer.param_groups for p in g["params"])


def test_supcon_head_on_one_and_two_views():
    from nclip.models.dual_encoder import build_model

    cfg = resolve("supcon-tiny", ["model.supcon_hidden=16", "model.supcon_dim=8", "data.image_size=16"])
    model = build_model(cfg, pretrained_text=False)
    ids, mask = torch.zeros(4, 16, dtype=torch.long), torch.ones(4, 16, dtype=torch.long)
    two = model(torch.randn(4, 2, 3, 16, 16), ids, mask)
    assert two.image["supcon"].shape == (4, 2, 8) and two.image_features.shape[0] == 4
    model.eval()
    one = model(torch.randn(4, 3, 16, 16), ids, mask)
    assert one.image["supcon"].shape == (4, 1, 8)
    assert not any(p.requires_grad for p in model.text.parameters())  # image-only: the text tower is frozen


def test_label_space_and_builtin_similarity():
    from nclip.data.labels import label_space_for

    cfg = resolve("supcon-tiny", ["objective.name=reco"])
    space = label_space_for(cfg)
    assert space.num_classes == 10 and space.classes[0] == "zero"
    s = space.similarity
    assert s.shape == (10, 10) and bool(((s >= 0) & (s <= 1)).all())
    assert label_space_for(resolve("supcon-tiny")).similarity is None  # supcon asks for no hierarchy
    assert label_space_for(resolve("micro")) is None  # xclip needs no label space


@pytest.mark.parametrize("extra,match", [
    (["data.source=csv", "data.csv=x.csv"], "objective supcon needs labelled data"),
    (["objective.name=reco", "objective.hierarchy=/nonexistent/tree.json"], "is not a file"),
    (["objective.temperature=0"], "objective.temperature: Input should be greater than 0"),
    (["objective.name=paco", "objective.beta=-1"], "objective.beta: Input should be greater than or equal to 0"),
    (["objective.name=reco", "objective.base=moco"], "objective.base"),
])
def test_bad_config_is_one_line(extra, match):
    with pytest.raises(NclipError, match=match) as e:
        resolve("supcon-tiny", extra)
    assert "\n" not in str(e.value)


def test_paco_needs_a_class_count():
    with pytest.raises(ValueError, match="needs objective.num_classes"):
        build_objective(PacoConfig())
    with pytest.raises(ValueError, match="below the 10 classes"):
        build_objective(PacoConfig(num_classes=3), None, label_space=LabelSpace(tuple("abcdefghij")))
    with pytest.raises(ValueError, match="needs the class similarity"):
        build_objective(RecoConfig())


def test_registered():
    for name in ("supcon", "paco", "reco", "clip_supcon"):
        assert name in REGISTRY
        assert REGISTRY[name][1].zero_shot == ("clip" if name == "clip_supcon" else None)


# ---- 2 ranks against 1 process --------------------------------------------------------------------


def _functional_cases(x: dict) -> dict:
    keep = _keep(_inputs(16)["labels"], V, cols=x["queue_labels"])  # the global mask, the same on every rank
    kw = {"queue": x["queue"], "queue_labels": x["queue_labels"]}
    return {
        "supcon": lambda a: functional.supcon_terms(a["z"], a["labels"], keep=keep, **kw)["loss"],
        "paco": lambda a: functional.paco_terms(a["z"], a["labels"], a["centers"], **kw)["loss"],
        "reco": lambda a: functional.reco_terms(a["z"], a["labels"], keep, centers=a["centers"], **kw)["loss"],
    }


def _rank(rank: int, world: int) -> dict:
    out = {case: loss_and_grads(_module_loss(case), _split(_inputs(16), rank, world)) for case in MODULES}
    out.update({f"f-{case}": loss_and_grads(fn, _split(_inputs(16), rank, world))
                for case, fn in _functional_cases(_inputs(16)).items()})
    x = _split(_inputs(16), rank, world)
    obj = SupconObjective(SupconConfig(queue_size=64), dim=D).double().train()
    obj(_out(x), row_batch(x["labels"]))
    out["queue"] = obj.queue.view()
    return out


@pytest.mark.slow
def test_two_ranks_match_one_process():
    results = run_ranks(_rank, 2)
    single = {case: _module_loss(case) for case in MODULES}
    single.update({f"f-{case}": fn for case, fn in _functional_cases(_inputs(16)).items()})
    for case, fn in single.items():
        ref_loss, ref_grads = only_leaves(loss_and_grads(fn, _split(_inputs(16), 0, 1)), LEAVES)
        loss, grads = combine_ranks([only_leaves(r[case], LEAVES) for r in results], ("z", "img", "txt"))
        torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12, msg=case)
        for k in ref_grads:
            torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-9, atol=1e-12, msg=f"{case}: d/d{k}")
    x = _inputs(16)
    obj = SupconObjective(SupconConfig(queue_size=64), dim=D).double().train()
    obj(_out(x), row_batch(x["labels"]))
    for r in results:  # the queue is global: every rank enqueued every view of the whole batch, in rank order
        torch.testing.assert_close(r["queue"].embeddings, obj.queue.view().embeddings)
        assert torch.equal(r["queue"].labels, obj.queue.view().labels)


# ---- training through the CLI ---------------------------------------------------------------------

TRAIN = ["data.image_size=16", "model.supcon_hidden=32", "model.supcon_dim=16", "train.batch_size=32",
         "train.threads=1", "train.log_every=1", "train.checkpoint_every=3", "train.keep_checkpoints=3",
         "train.steps=8", "objective.name=reco", "objective.base=paco", "objective.queue_size=96"]


def _rows(path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:
        for key in WALL_CLOCK:
            r.pop(key, None)
    return rows


@pytest.mark.slow
def test_reco_trains_and_resumes_bitwise(tmp_path):
    from nclip.cli import main

    from conftest import train_and_kill

    def args(out):
        return ["train", "--preset", "supcon-tiny", "--out", str(out), "--no-progress", "--no-eval"] + \
            [x for o in TRAIN for x in ("--set", o)]

    assert main(args(tmp_path / "reference")) == 0
    expected = _rows(tmp_path / "reference" / "metrics.jsonl")
    assert [r["step"] for r in expected] == list(range(1, 9))
    assert all(0 < r["reco/kept"] <= 1 and r["reco/queue_fill"] > 0 for r in expected)
    run = tmp_path / "killed"
    train_and_kill(args(run), run / "metrics.jsonl", 5)  # killed after step 5: resumes from step 3
    assert main(args(run) + ["--resume", "auto"]) == 0
    assert _rows(run / "metrics.jsonl") == expected  # the draws, the queue and the centres continue exactly
