"""CMSF as a trained objective (``cmsf``, ``clip_cmsf``) and the cross-entropy baseline (``xent``):
the modules against float64 transcriptions (values and gradients), on 2 ranks against 1 process, the
data they need (two views, labels), the momentum hook, and short ``nclip train`` runs (2 ranks,
SIGKILL + resume) through the CLI and the loop."""

from __future__ import annotations

import json
import random

import pytest
import torch

from batches import row_batch
from nclip.cli import main
from nclip.config import resolve
from nclip.errors import NclipError
from nclip.objectives import EncoderOutput
from nclip.objectives.cmsf import ClipCmsfConfig, ClipCmsfObjective, CmsfConfig, CmsfObjective
from nclip.objectives.xent import XentConfig, XentObjective
from nclip.train.logbook import WALL_CLOCK

from conftest import train_and_kill
from distributed_utils import combine_ranks, loss_and_grads, only_leaves, run_ranks, split_rows
from references import assert_loss_and_grads_close, ref_clip, ref_clip_algorithm1, ref_cmsf

B, D, N, CLASSES = 8, 6, 12, 3


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return {"v": r(B, D), "u": r(B, D), "img": r(B, D), "txt": r(B, D), "logits": r(B, CLASSES),
            "scale": torch.tensor(7.0, dtype=torch.float64),
            "labels": torch.randint(0, CLASSES, (B,), generator=g),
            "true": torch.randint(0, CLASSES, (B,), generator=g),
            "bank": r(N, D), "bank_labels": torch.randint(0, CLASSES, (N,), generator=g),
            # cross-modal: a frozen embedding of N + B samples; the bank holds samples 0..N-1, the batch the rest
            "frozen": r(N + B, 3), "bank_index": torch.arange(N), "index": torch.arange(N, N + B).flip(0)}


def ref_cross_modal_mask(frozen, index, bank_index, n):
    """Sec. 2.3, one query at a time: the n candidates (the batch, then the bank) nearest to the query
    in the frozen embedding, by cosine, the query itself included (cosine 1)."""
    f = frozen / frozen.norm(dim=1, keepdim=True)
    cands = [int(i) for i in index] + [int(i) for i in bank_index]
    mask = torch.zeros(len(index), len(cands), dtype=torch.bool)
    for q, qi in enumerate(index):
        order = sorted(range(len(cands)), key=lambda j: -float((f[int(qi)] * f[cands[j]]).sum()))
        mask[q, order[:n]] = True
    return mask


def _out(x: dict) -> EncoderOutput:
    return EncoderOutput(image_features=x["img"], text_features=x["txt"], logit_scale=x["scale"],
                         image={"clip": x["img"], "cmsf_pred": x["v"], "cmsf_target": x["u"], "xent": x["logits"]},
                         text={"clip": x["txt"]})


def _objective(name: str, x: dict, **cfg):
    """The module in float64 with its bank holding x's bank rows (labels, and clean labels = labels)."""
    if name == "xent":
        return XentObjective(XentConfig(**cfg)).double()
    config = (CmsfConfig if name == "cmsf" else ClipCmsfConfig)(bank_size=N + B, **cfg)
    obj = (CmsfObjective if name == "cmsf" else ClipCmsfObjective)(config, dim=D).double()
    obj.bank.enqueue(x["bank"], x["bank_labels"], global_batch=False)
    obj.true_bank.enqueue(torch.ones(N, 1, dtype=torch.float64), x["bank_labels"], global_batch=False)
    if config.constraint == "cross_modal":
        obj.index_bank.enqueue(torch.ones(N, 1, dtype=torch.float64), x["bank_index"], global_batch=False)
        obj.attach_frozen_embedding(x["frozen"])
    return obj.train()


def _module_loss(name: str, **cfg):
    def loss(x: dict) -> torch.Tensor:
        index = (x["index"],) if cfg.get("constraint") == "cross_modal" else ()
        return _objective(name, x, **cfg)(_out(x), row_batch(x["labels"], x["true"], *index))["loss"]

    return loss


def _ref_xent(logits, labels):
    z = logits - logits.max(1, keepdim=True).values.detach()
    return -(z.gather(1, labels[:, None]).squeeze(1) - z.exp().sum(1).log()).mean()


REFERENCES = {  # name -> (config, reference of the loss)
    "cmsf": ({"k": 3}, lambda x: ref_cmsf(x["v"], x["u"], x["bank"], 3, x["labels"], x["bank_labels"])),
    "cmsf-none-topall": ({"k": None, "constraint": "none"}, lambda x: ref_cmsf(x["v"], x["u"], x["bank"], None)),
    "cmsf-no-target": ({"k": 2, "include_target": False},
                       lambda x: ref_cmsf(x["v"], x["u"], x["bank"], 2, x["labels"], x["bank_labels"], False)),
    "clip_cmsf": ({"k": 4, "w_clip": 0.7, "w_cmsf": 1.3},
                  lambda x: 0.7 * ref_clip(x["img"], x["txt"], x["scale"])
                  + 1.3 * ref_cmsf(x["v"], x["u"], x["bank"], 4, x["labels"], x["bank_labels"])),
    # issue 27.2: L_CLIP as Algorithm 1 writes it, the sum of both InfoNCE directions
    "clip_cmsf-sum": ({"k": 4, "w_clip": 0.7, "w_cmsf": 1.3, "clip_reduction": "sum"},
                      lambda x: 0.7 * ref_clip_algorithm1(x["img"], x["txt"], x["scale"])
                      + 1.3 * ref_cmsf(x["v"], x["u"], x["bank"], 4, x["labels"], x["bank_labels"])),
    "cmsf-cross-modal": ({"k": 3, "k_prime": 6, "constraint": "cross_modal"},
                         lambda x: ref_cmsf(x["v"], x["u"], x["bank"], 3,
                                            mask=ref_cross_modal_mask(x["frozen"], x["index"], x["bank_index"], 6))),
    "xent": ({}, lambda x: _ref_xent(x["logits"], x["labels"])),
}
LEAVES = ("v", "u", "img", "txt", "logits", "scale")
ROWS = ("v", "u", "img", "txt", "logits", "labels", "true", "index")


def _split(x: dict, rank: int, world: int) -> dict:
    """This rank's rows (floats as fresh leaves that require grad, labels as they are)."""
    return split_rows(x, ROWS, rank, world, leaves=LEAVES)


@pytest.mark.parametrize("case", list(REFERENCES))
def test_objective_matches_float64_reference(case):
    cfg, ref = REFERENCES[case]
    a, b = _split(_inputs(), 0, 1), _split(_inputs(), 0, 1)
    ga = assert_loss_and_grads_close(_module_loss(case.split("-")[0], **cfg)(a), ref(b), a, b, LEAVES, case)
    assert ga[0] is not None or case == "xent"


def test_cmsf_enqueues_the_batch_and_logs_its_diagnostics():
    x = _inputs(1)
    obj = _objective("cmsf", x, k=3)
    terms = obj(_out(x), row_batch(x["labels"], x["true"]))
    view = obj.bank.view()
    torch.testing.assert_close(view.embeddings[-B:], torch.nn.functional.normalize(x["u"], dim=-1))
    assert torch.equal(view.labels[-B:], x["labels"]) and torch.equal(obj.true_bank.view().labels[-B:], x["true"])
    assert set(terms) >= {"loss", "cmsf/loss", "cmsf/purity", "cmsf/bank_fill", "cmsf/constrained_size",
                          "cmsf/neighbours", "cmsf/momentum"}
    assert terms["cmsf/bank_fill"] == 1.0 and terms["cmsf/momentum"] == pytest.approx(0.99)
    obj.eval()
    obj(_out(x), row_batch(x["labels"], x["true"]))
    assert int(obj.bank.ptr) == 0 and torch.equal(obj.bank.view().labels[-B:], x["labels"])  # eval: no enqueue


def test_semi_supervised_bank_pair():
    x = _inputs(2)
    obj = CmsfObjective(CmsfConfig(constraint="semi", k=3, bank_size=32), dim=D).double().train()
    labels = x["labels"].clone()
    labels[::2] = -1  # unlabelled rows
    obj(_out(x), row_batch(labels, x["true"]))
    assert int(obj.bank.filled) == B and int(obj.labelled_bank.filled) == B // 2


def _rank(rank: int, world: int) -> dict:
    out = {}
    for case, (cfg, _) in REFERENCES.items():
        out[case] = loss_and_grads(_module_loss(case.split("-")[0], **cfg), _split(_inputs(), rank, world))
    x = _split(_inputs(), rank, world)
    obj = _objective("cmsf", x, k=3)
    obj(_out(x), row_batch(x["labels"], x["true"]))
    out["bank"] = obj.bank.view().embeddings
    return out


@pytest.mark.slow
def test_two_ranks_match_one_process():
    results = run_ranks(_rank, 2)
    rows = ("v", "u", "img", "txt", "logits")
    for case, (cfg, _) in REFERENCES.items():
        ref_loss, ref_grads = only_leaves(loss_and_grads(_module_loss(case.split("-")[0], **cfg),
                                                         _split(_inputs(), 0, 1)), LEAVES)
        loss, grads = combine_ranks([only_leaves(r[case], LEAVES) for r in results], rows)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
        for k in ref_grads:
            torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-9, atol=1e-12, msg=f"{case}: d/d{k}")
    x = _inputs()
    single = _objective("cmsf", x, k=3)
    single(_out(x), row_batch(x["labels"], x["true"]))
    for r in results:  # the bank is global: every rank enqueued the whole batch, in rank order
        torch.testing.assert_close(r["bank"], single.bank.view().embeddings)


# ---------------------------------------------------------------------------------------------
# config: one-line errors
# ---------------------------------------------------------------------------------------------

MICRO = ["data.source=digits", "objective.name=cmsf", "objective.bank_size=64", "model.cmsf_hidden=32",
         "model.cmsf_dim=16", "train.threads=1", "train.log_every=1", "train.batch_size=16"]


@pytest.mark.parametrize("extra,match", [
    (["objective.k=0"], "objective.k: Input should be greater than or equal to 1"),
    (["objective.bank_size=8"], "bank_size 8 is smaller than the batch"),
    (["data.source=csv", "data.csv=x.csv"], "constraint labels needs labelled data"),
    (["objective.constraint=cross_modal", "data.source=webdataset", "data.shards=x.tar"],
     "cross_modal needs the captions of a map-style source"),
    (["objective.constraint_encoder=/x"], "constraint_encoder and constraint_modality need constraint cross_modal"),
    (["objective.label_noise=0.3"], "label_noise 0.3 needs constraint noisy_labels"),
    (["objective.name=xent", "data.source=csv", "data.csv=x.csv"], "xent needs labelled data"),
])
def test_bad_config_is_one_line(extra, match):
    base = [o for o in MICRO if not o.startswith("objective.")] if "objective.name=xent" in extra else MICRO
    with pytest.raises(NclipError, match=match) as e:
        resolve("micro", base + extra)
    assert "\n" not in str(e.value)


def test_unknown_label_key_is_one_line(tmp_path, capsys):
    args = ["train", "--preset", "micro", "--out", str(tmp_path / "r"), "--no-progress", "--no-eval"]
    args += [a for o in MICRO + ["objective.label_key=shape", "train.steps=1"] for a in ("--set", o)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "label_key 'shape' is not a label of data.source digits" in err and "\n" not in err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_presets_reproduce_what_they_say():
    for name in ("cmsf-tiny", "cmsf-noisy-tiny", "cmsf-rn50-in1k"):
        cfg = resolve(name)
        assert cfg.objective.name == "cmsf" and cfg.objective.k == 10
    paper = resolve("cmsf-rn50-in1k")
    assert (paper.train.optimizer, paper.train.lr, paper.train.momentum,
            paper.train.weight_decay) == ("sgd", 0.05, 0.9, 1e-4)
    assert (paper.train.batch_size, paper.objective.bank_size, paper.objective.momentum) == (256, 128_000, 0.99)
    assert (paper.model.vision.kind, paper.model.cmsf_hidden, paper.model.cmsf_dim) == ("resnet", 4096, 512)
    # Sec. 2's supervised CMSF on ImageNet's class folders (issue 27.1), 200 epochs of 1,281,167 images
    assert (paper.objective.constraint, paper.data.source, paper.objective.momentum_schedule) == (
        "labels", "folder", "constant")
    assert paper.train.steps == 200 * (1_281_167 // 256)  # the schedule is cosine (nclip has no other)
    assert resolve("cmsf-noisy-tiny").objective.label_noise == 0.5
    xmodal = resolve("cmsf-xmodal-tiny").objective  # Tab. 3's n = 10, k = 5, captions by the bundled MiniLM
    assert (xmodal.constraint, xmodal.k_prime, xmodal.k, xmodal.constraint_encoder) == ("cross_modal", 10, 5, None)


# ---------------------------------------------------------------------------------------------
# data: two views, labels
# ---------------------------------------------------------------------------------------------


def _batches(cfg, start=0, rank=0, world=1, labels=True):
    from nclip.data.loader import train_loader
    from nclip.data.tokenization import CaptionTokenizer
    from nclip.objectives.base import LabelRequest

    request = LabelRequest(noise=cfg.objective.label_noise) if labels else None
    return list(train_loader(cfg, CaptionTokenizer(cfg.data.text_length), start_step=start, rank=rank,
                             world_size=world, views=2, labels=request))


def test_two_views_differ_are_reproducible_and_split_over_ranks():
    cfg = resolve("micro", MICRO + ["train.steps=3"])
    full = _batches(cfg)
    pixels, labels, true = full[0].pixels, full[0].labels, full[0].true_labels
    assert pixels.shape == (16, 2, 3, 16, 16) and labels.shape == true.shape == (16,)
    assert not torch.equal(pixels[:, 0], pixels[:, 1])  # online (strong) and target (weak) views differ
    assert torch.equal(labels, true)  # no noise
    again = _batches(cfg)
    for a, b in zip(full, again):
        assert all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors()))
    resumed = _batches(cfg, start=2)  # a resumed run sees the same views
    assert all(torch.equal(x, y) for x, y in zip(resumed[0].tensors(), full[2].tensors()))
    halves = [_batches(cfg, rank=r, world=2) for r in range(2)]
    for step in range(3):  # 2 ranks hold the halves of the single process's batch, views included
        for first, second, whole in zip(halves[0][step].tensors(), halves[1][step].tensors(), full[step].tensors()):
            assert torch.equal(torch.cat([first, second]), whole)
    assert not torch.equal(full[0].pixels, full[1].pixels[: full[0].pixels.shape[0]])


def test_noisy_labels_have_the_exact_rate_and_keep_the_clean_ones():
    from nclip.data.label_noise import RowLabels
    from nclip.objectives.base import LabelRequest

    rows = RowLabels(1000, 10, LabelRequest(noise=0.25), seed=3)
    pairs = [rows(i, i % 10) for i in range(1000)]
    assert sum(t != c for t, c in pairs) == 250 and all(c == i % 10 for i, (_, c) in enumerate(pairs))
    assert pairs == [RowLabels(1000, 10, LabelRequest(noise=0.25), seed=3)(i, i % 10) for i in range(1000)]
    semi = RowLabels(1000, 10, LabelRequest(labelled=0.1), seed=3)
    assert sum(semi(i, 1)[0] == -1 for i in range(1000)) == 900
    cfg = resolve("micro", MICRO + ["train.steps=40", "objective.constraint=noisy_labels", "objective.label_noise=0.5"])
    got = torch.cat([torch.stack([b.labels, b.true_labels]) for b in _batches(cfg)], 1)  # [2, rows]
    share = (got[0] != got[1]).float().mean()
    assert 0.4 < share < 0.6


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------


def _rows(path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:
        for key in WALL_CLOCK:
            r.pop(key, None)
    return rows


def _train_args(out, overrides) -> list[str]:
    return ["train", "--preset", "micro", "--out", str(out), "--no-progress"] + \
        [x for o in MICRO + overrides for x in ("--set", o)]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cmsf", "clip_cmsf"])
def test_nclip_train_runs_cmsf(tmp_path, name):
    extra = ["train.steps=40", "train.lr=3e-3", f"objective.name={name}", "eval.samples=100"]
    assert main(_train_args(tmp_path, extra)) == 0
    rows = _rows(tmp_path / "metrics.jsonl")
    first, last = (sum(r["cmsf/loss"] for r in part) / 5 for part in (rows[:5], rows[-5:]))
    assert last < first, (first, last)
    assert rows[0]["cmsf/bank_fill"] == 0.25 and rows[-1]["cmsf/bank_fill"] == 1.0
    for key in ("cmsf/purity", "cmsf/constrained_size", "cmsf/momentum", "cmsf/neighbours"):
        assert key in rows[-1]
    assert rows[-1]["cmsf/purity"] == 1.0  # clean labels: every neighbour has the query's label
    ev = json.loads((tmp_path / "eval.json").read_text())
    assert ("knn/digit/top1" in ev) if name == "cmsf" else ("zeroshot/digit/top1" in ev)
    from safetensors.torch import load_file

    w = load_file(str(tmp_path / "model" / "model.safetensors"))
    assert any(k.startswith("heads.cmsf.target_vision.") for k in w)
    assert not torch.equal(w["heads.cmsf.target_image.0.weight"], w["heads.cmsf.image.0.weight"])
    if name == "cmsf":  # nclip eval: the text tasks are skipped with a reason, the probes run
        from nclip.eval.runner import run_eval

        doc = run_eval(tmp_path, out=None, tasks=("zeroshot", "retrieval", "knn"), datasets=("digits",),
                       cache_dir=None, report=False)
        assert set(doc["skipped"]) == {"zeroshot", "retrieval"} and "no text-aligned head" in doc["skipped"]["zeroshot"]
        assert "knn/digits-digit/top1" in doc["results"]


@pytest.mark.slow
def test_momentum_hook_once_per_taken_step(tmp_path, monkeypatch):
    from nclip.train.loop import train

    calls, forwards = [], []
    original_forward, original_after = CmsfObjective.forward, CmsfObjective.after_step

    def forward(self, out, batch):
        terms = original_forward(self, out, batch)
        forwards.append(1)
        if len(forwards) == 3:  # the third step is not finite: skipped, no momentum update
            terms["loss"] = terms["loss"] * float("nan")
        return terms

    def after_step(self, model, step, total, taken):
        calls.append((step, total, float(taken)))
        return original_after(self, model, step, total, taken)

    monkeypatch.setattr(CmsfObjective, "forward", forward)
    monkeypatch.setattr(CmsfObjective, "after_step", after_step)
    train(resolve("micro", MICRO + ["train.steps=5"]), tmp_path, progress=False, evaluate=False)
    # called after every step, the skipped one with taken = 0 (gated on the device: no momentum update)
    assert calls == [(0, 5, 1.0), (1, 5, 1.0), (2, 5, 0.0), (3, 5, 1.0), (4, 5, 1.0)]
    rows = _rows(tmp_path / "metrics.jsonl")
    assert rows[2]["nonfinite_steps"] == 1
    # the skipped step's enqueue is undone (the bank is a buffer): the next step fills the same rows
    assert [r["cmsf/bank_fill"] for r in rows] == [0.25, 0.5, 0.75, 0.75, 1.0]


RESUME = ["train.steps=16", "train.checkpoint_every=3", "train.keep_checkpoints=3", "objective.constraint=noisy_labels",
          "objective.label_noise=0.5", "objective.bank_size=48", "objective.momentum_schedule=cosine",
          "train.optimizer=sgd", "train.lr=0.05"]


@pytest.mark.slow
def test_sigkill_then_resume_continues_bitwise(tmp_path):
    from nclip.train.loop import train

    reference = tmp_path / "reference"
    train(resolve("micro", MICRO + RESUME), reference, progress=False, evaluate=False)
    expected = _rows(reference / "metrics.jsonl")
    kill_after = random.Random().randint(4, 13)
    run = tmp_path / "killed"
    args = _train_args(run, RESUME) + ["--no-eval"]
    metrics = run / "metrics.jsonl"
    train_and_kill(args, metrics, kill_after)
    assert main(args + ["--resume", "auto"]) == 0
    assert _rows(metrics) == expected


def _loop_rank(rank: int, world: int, root: str) -> None:
    from pathlib import Path

    from nclip.train.loop import train

    train(resolve("micro", MICRO + TWO_RANKS), Path(root) / "ddp", progress=False, evaluate=False)


TWO_RANKS = ["train.steps=4", "objective.bank_size=32", "objective.name=clip_cmsf"]


@pytest.mark.slow
def test_training_loop_on_two_ranks(tmp_path):
    from nclip.train.loop import train

    run_ranks(_loop_rank, 2, args=(str(tmp_path),), init="torchrun")
    train(resolve("micro", MICRO + TWO_RANKS), tmp_path / "single", progress=False, evaluate=False)
    single, ddp = _rows(tmp_path / "single" / "metrics.jsonl"), _rows(tmp_path / "ddp" / "metrics.jsonl")
    assert [r["step"] for r in ddp] == [1, 2, 3, 4]
    for a, b in zip(ddp, single):
        assert set(a) == set(b)
        for k in b:
            if k == "cmsf/purity":  # a ratio of per-rank sums, averaged over ranks: not the global ratio
                continue
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=5e-5), (a["step"], k)
