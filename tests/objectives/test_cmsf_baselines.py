"""CMSF's baselines of Sec. 2.1.1 (``protonw``, ``frzproto``): the functions and the trainer modules
against float64 transcriptions of the paper's text (references.ref_protonw, ref_frzproto; values and
gradients), on 2 ranks against 1 process, their bank and prototypes, their config refusals and a
short ``nclip train`` each. Exact accumulation is covered by tests/train/test_accumulate.py (every
registered objective)."""

from __future__ import annotations

import json

import pytest
import torch

from batches import row_batch
from nclip.cli import main
from nclip.config import resolve
from nclip.data.labels import label_space_for
from nclip.errors import NclipError
from nclip.objectives import REGISTRY, EncoderOutput, build_objective, functional
from nclip.objectives.cmsf_baselines import FrzProtoConfig, FrzProtoObjective, ProtoNwConfig, ProtoNwObjective

from distributed_utils import combine_ranks, loss_and_grads, only_leaves, run_ranks, split_rows
from references import assert_loss_and_grads_close, ref_frzproto, ref_protonw

B, D, N, CLASSES = 8, 6, 12, 4
EXTRA = 2  # classes beyond those in the data: no prototype, left out of ProtoNW's softmax


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return {"v": r(B, D), "u": r(B, D), "z": r(B, D), "protos": r(CLASSES + EXTRA, D),
            "labels": torch.randint(0, CLASSES, (B,), generator=g),
            "true": torch.randint(0, CLASSES, (B,), generator=g),
            "bank": r(N, D), "bank_labels": torch.randint(0, CLASSES, (N,), generator=g)}


LEAVES = ("v", "u", "z", "bank", "protos")
ROWS = ("v", "u", "z", "labels", "true")


def _split(x: dict, rank: int, world: int) -> dict:
    return split_rows(x, ROWS, rank, world, leaves=LEAVES)


# ---- the functions ------------------------------------------------------------------------------


@pytest.mark.parametrize("with_batch", [False, True], ids=["bank (the paper)", "bank and batch"])
@pytest.mark.parametrize("tau", [0.1, 0.7])
def test_protonw_terms_match_float64_reference(tau, with_batch):
    a, b = _split(_inputs(), 0, 1), _split(_inputs(), 0, 1)
    for x in (a, b):  # the first query's class has no instance in the bank: no term without the batch
        lonely = int(x["labels"][0])
        x["bank_labels"] = x["bank_labels"].masked_fill(x["bank_labels"] == lonely, (lonely + 1) % CLASSES)
    ours = functional.protonw_terms(a["v"], a["u"], a["bank"], a["labels"], a["bank_labels"],
                                    num_classes=CLASSES + EXTRA, temperature=tau, batch_in_prototypes=with_batch)
    ref = ref_protonw(b["v"], b["u"], b["bank"], b["labels"], b["bank_labels"], tau, with_batch=with_batch)
    grads = assert_loss_and_grads_close(ours["loss"], ref, a, b, ("v", "u", "bank"), f"tau {tau}")
    assert grads[0] is not None and grads[1] is None and grads[2] is None  # v only


def test_protonw_a_query_whose_class_is_not_in_the_bank_adds_nothing():
    x = _inputs(4)
    x["labels"][:2] = 0
    bank_labels = torch.where(x["bank_labels"] == 0, torch.ones_like(x["bank_labels"]), x["bank_labels"])  # no 0
    v = x["v"].clone().requires_grad_(True)
    loss = functional.protonw_terms(v, x["u"], x["bank"], x["labels"], bank_labels, num_classes=CLASSES)["loss"]
    loss.backward()
    lonely = x["labels"] == 0
    assert lonely.any() and torch.all(v.grad[lonely] == 0) and torch.all(v.grad[~lonely].abs().sum(1) > 0)
    with_batch = functional.protonw_terms(x["v"], x["u"], x["bank"], x["labels"], bank_labels, num_classes=CLASSES,
                                          batch_in_prototypes=True)["loss"]
    assert with_batch != loss  # the option's prototypes are another objective


def test_protonw_with_an_empty_bank_and_unknown_class_count():
    """Warm-up: with the batch's targets the prototypes are the batch's own; from the bank alone there
    is none yet and the loss is 0 (no gradient); num_classes None reads max label + 1."""
    a, b = _split(_inputs(1), 0, 1), _split(_inputs(1), 0, 1)
    empty = torch.zeros(0, D, dtype=torch.float64)
    ours = functional.protonw_terms(a["v"], a["u"], empty, a["labels"], torch.zeros(0, dtype=torch.long),
                                    batch_in_prototypes=True)
    ref = ref_protonw(b["v"], b["u"], empty, b["labels"], torch.zeros(0, dtype=torch.long), 0.1, with_batch=True)
    assert_loss_and_grads_close(ours["loss"], ref, a, b, ("v",))
    assert ours["classes"] == len(set(a["labels"].tolist()))
    bank_only = functional.protonw_terms(a["v"], a["u"], empty, a["labels"], torch.zeros(0, dtype=torch.long))
    assert bank_only["loss"] == 0 and bank_only["classes"] == 0


def test_protonw_unlabelled_rows_belong_to_no_prototype():
    x = _inputs(2)
    bank_labels = x["bank_labels"].clone()
    bank_labels[::3] = functional.UNLABELLED
    keep = bank_labels != functional.UNLABELLED
    got = functional.protonw_terms(x["v"], x["u"], x["bank"], x["labels"], bank_labels, num_classes=CLASSES)["loss"]
    want = ref_protonw(x["v"], x["u"], x["bank"][keep], x["labels"], bank_labels[keep], 0.1)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_frzproto_terms_match_float64_reference():
    a, b = _split(_inputs(), 0, 1), _split(_inputs(), 0, 1)
    t = functional.frzproto_terms(a["z"], a["protos"], a["labels"], true_labels=a["true"])
    grads = assert_loss_and_grads_close(t["loss"], ref_frzproto(b["z"], b["protos"], b["labels"]), a, b,
                                        ("z", "protos"))
    assert grads[1] is None  # the prototypes are frozen
    cos = torch.nn.functional.normalize(a["z"], dim=1) @ torch.nn.functional.normalize(a["protos"], dim=1).T
    assert t["acc"] == (cos.argmax(1) == a["labels"]).double().mean()
    assert t["clean_acc"] == (cos.argmax(1) == a["true"]).double().mean()


def test_protonw_and_frzproto_compute_in_float32_finite_at_extremes():
    x = _inputs(3)
    v, u = 1e4 * x["v"].float(), 1e-4 * x["u"].float()
    t = functional.protonw_terms(v, u, x["bank"].float(), x["labels"], x["bank_labels"], num_classes=CLASSES,
                                 temperature=1e-3)
    assert t["loss"].dtype == torch.float32 and torch.isfinite(t["loss"])
    f = functional.frzproto_terms(1e4 * x["z"].float(), x["protos"].float(), x["labels"])
    assert f["loss"].dtype == torch.float32 and torch.isfinite(f["loss"])


def test_frozen_prototypes_are_seeded_unit_vectors():
    p = functional.frozen_prototypes(5, 7, seed=3)
    assert p.shape == (5, 7) and torch.allclose(p.norm(dim=1), torch.ones(5))
    assert torch.equal(p, functional.frozen_prototypes(5, 7, seed=3))
    assert not torch.equal(p, functional.frozen_prototypes(5, 7, seed=4))


# ---- the trainer modules --------------------------------------------------------------------------


def _out(x: dict) -> EncoderOutput:
    return EncoderOutput(image_features=x["z"], text_features=None, logit_scale=torch.tensor(1.0, dtype=torch.float64),
                         image={"cmsf_pred": x["v"], "cmsf_target": x["u"], "supcon": x["z"][:, None]})


def _objective(name: str, x: dict, **cfg):
    """The module in float64: ProtoNW with its bank holding x's bank rows, FrzProto with x's prototypes."""
    if name == "frzproto":
        obj = FrzProtoObjective(FrzProtoConfig(**cfg), dim=D, num_classes=CLASSES + EXTRA).double()
        obj.prototypes.copy_(x["protos"].detach())
        return obj.train()
    obj = ProtoNwObjective(ProtoNwConfig(bank_size=N + B, **cfg), dim=D, num_classes=CLASSES + EXTRA).double()
    obj.bank.enqueue(x["bank"].detach(), x["bank_labels"], global_batch=False)
    return obj.train()


def _module_loss(name: str, **cfg):
    def loss(x: dict) -> torch.Tensor:
        return _objective(name, x, **cfg)(_out(x), row_batch(x["labels"], x["true"]))["loss"]

    return loss


MODULE_REFERENCES = {  # case -> (objective, config, reference of the loss)
    "protonw": ("protonw", {}, lambda x: ref_protonw(x["v"], x["u"], x["bank"], x["labels"], x["bank_labels"], 0.1)),
    "protonw-tau": ("protonw", {"temperature": 0.5},
                    lambda x: ref_protonw(x["v"], x["u"], x["bank"], x["labels"], x["bank_labels"], 0.5)),
    "frzproto": ("frzproto", {}, lambda x: ref_frzproto(x["z"], x["protos"], x["labels"])),
}


@pytest.mark.parametrize("case", list(MODULE_REFERENCES))
def test_objective_matches_float64_reference(case):
    name, cfg, ref = MODULE_REFERENCES[case]
    a, b = _split(_inputs(), 0, 1), _split(_inputs(), 0, 1)
    grads = assert_loss_and_grads_close(_module_loss(name, **cfg)(a), ref(b), a, b, ("v", "u", "z"), case)
    used = grads[0] if name == "protonw" else grads[2]
    assert used is not None


def _rank(rank: int, world: int) -> dict:
    out = {case: loss_and_grads(_module_loss(name, **cfg), _split(_inputs(), rank, world))
           for case, (name, cfg, _) in MODULE_REFERENCES.items()}
    x = _split(_inputs(), rank, world)
    obj = _objective("protonw", x)
    obj(_out(x), row_batch(x["labels"], x["true"]))
    out["bank"] = obj.bank.view()
    return out


@pytest.mark.slow
def test_two_ranks_match_one_process():
    results = run_ranks(_rank, 2)
    for case, (name, cfg, _) in MODULE_REFERENCES.items():
        ref_loss, ref_grads = only_leaves(loss_and_grads(_module_loss(name, **cfg), _split(_inputs(), 0, 1)),
                                          ("v", "u", "z"))
        loss, grads = combine_ranks([only_leaves(r[case], ("v", "u", "z")) for r in results], ("v", "u", "z"))
        torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
        for k in ref_grads:
            torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-9, atol=1e-12, msg=f"{case}: d/d{k}")
    x = _inputs()
    single = _objective("protonw", x)
    single(_out(x), row_batch(x["labels"], x["true"]))
    for r in results:  # the bank is global: every rank enqueued the whole batch, in rank order
        torch.testing.assert_close(r["bank"].embeddings, single.bank.view().embeddings)
        assert torch.equal(r["bank"].labels, single.bank.view().labels)


def test_protonw_enqueues_logs_and_moves_its_target():
    x = _inputs(4)
    obj = _objective("protonw", x)
    terms = obj(_out(x), row_batch(x["labels"], x["true"]))
    view = obj.bank.view()
    torch.testing.assert_close(view.embeddings[-B:], torch.nn.functional.normalize(x["u"], dim=-1))
    assert torch.equal(view.labels[-B:], x["labels"])
    assert set(terms) == {"loss", "protonw/loss", "protonw/acc", "protonw/clean_acc", "protonw/classes",
                          "protonw/bank_fill", "protonw/momentum"}
    assert terms["protonw/classes"] == len(set(x["labels"].tolist() + x["bank_labels"].tolist()))
    assert terms["protonw/bank_fill"] == 1.0 and terms["protonw/momentum"] == pytest.approx(0.99)
    obj.eval()
    obj(_out(x), row_batch(x["labels"], x["true"]))
    assert int(obj.bank.ptr) == 0  # eval: no enqueue
    assert ProtoNwObjective.after_step is REGISTRY["cmsf"][1].after_step  # CMSF's momentum update


def test_frzproto_prototypes_are_a_frozen_seeded_buffer():
    cfg = resolve("cmsf-tiny", ["objective={name: frzproto}", "model.supcon_dim=16", "seed=5"])
    obj = build_objective(cfg.objective, cfg, label_space=label_space_for(cfg))
    assert obj.prototypes.shape == (10, 16) and "prototypes" in obj.state_dict()  # digits: 10 classes
    assert not list(obj.parameters())  # nothing of it is trained
    torch.testing.assert_close(obj.prototypes, functional.frozen_prototypes(10, 16, seed=5))


# ---- config and a short run ---------------------------------------------------------------------

SIZES = ["data.source=digits", "model.cmsf_hidden=32", "model.cmsf_dim=16", "model.supcon_hidden=32",
         "model.supcon_dim=16", "train.threads=1", "train.log_every=1", "train.batch_size=16"]


def _overrides(name: str, *extra: str) -> list[str]:
    bank = ["objective.bank_size=64"] if name == "protonw" else []
    return [f"objective.name={name}", *SIZES, *bank, *extra]


@pytest.mark.parametrize("name,extra,match", [
    ("protonw", ["data.source=csv", "data.csv=x.csv"], "constraint labels needs labelled data"),
    ("protonw", ["objective.label_noise=0.3"], "label_noise 0.3 needs constraint noisy_labels"),
    ("protonw", ["objective.constraint=semi"], "objective.constraint"),
    ("protonw", ["objective.bank_size=8"], "bank_size 8 is smaller than the batch"),
    ("frzproto", ["data.source=csv", "data.csv=x.csv"], "frzproto needs labelled data"),
])
def test_bad_config_is_one_line(name, extra, match):
    with pytest.raises(NclipError, match=match) as e:
        resolve("micro", _overrides(name, *extra))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["protonw", "frzproto"])
def test_a_short_run_trains_and_logs(name, tmp_path):
    args = ["train", "--preset", "micro", "--out", str(tmp_path / "r"), "--no-progress", "--no-eval"]
    args += [a for o in _overrides(name, "train.steps=3") for a in ("--set", o)]
    assert main(args) == 0
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if f"{name}/loss" in r]
    assert len(logged) == 3 and all(r[f"{name}/loss"] == r[f"{name}/loss"] for r in logged)  # finite


def test_the_tab1_grid_file_configures_every_row():
    """benchmarks/cmsf_baselines.yaml (docs/cmsf.md): every row resolves on cmsf-tiny to the method it names."""
    from pathlib import Path

    from nclip.sweep import expand, load_grid_file

    grid, settings = load_grid_file(Path(__file__).parents[2] / "benchmarks" / "cmsf_baselines.yaml")
    runs = expand(grid, settings)
    assert len(runs) == 12 and {r.assign["seed"] for r in runs} == {0, 1}
    for run in runs:
        obj = resolve("cmsf-tiny", run.set_args()).objective
        assert obj.name == run.name.split("-")[0]
        if obj.name == "cmsf":
            assert obj.k == (None if run.name == "cmsf-topall" else 10)
