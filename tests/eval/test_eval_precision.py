"""Evaluation at inference precision (issue 32 item 4): the towers encode under the run's autocast
(``train.precision``; bf16 on CUDA by default) and every score is computed in float32, during
training, at the end of a run and in ``nclip eval``. On the CPU, with bf16 autocast, the scores
match the float32 path within bounds derived from bf16's rounding (below)."""

from __future__ import annotations

import json

import pytest
import torch

from nclip.cli import main
from nclip.config import resolve
from nclip.data.sources import build_dataset
from nclip.eval import retrieval, zeroshot
from nclip.eval.features import class_text_outputs, extract, similarity
from nclip.models import build_model
from nclip.models.dual_encoder import DualEncoder
from nclip.objectives.scores import score_named

from conftest import micro_sizes

pytestmark = pytest.mark.usefixtures("one_thread")

U = 2.0**-8  # bf16's unit roundoff: 8 significant bits


def _model_and_data(*extra):
    cfg = resolve("micro", micro_sizes() + ["objective.name=xclip", *extra])  # the clip and nclip heads
    torch.manual_seed(0)
    return cfg, build_model(cfg, pretrained_text=False).eval(), build_dataset(cfg, "test", length=64)


def _tolerances(*pairs: tuple[dict, dict]) -> dict[str, float]:
    """|S_bf16 − S_fp32| bounds per head, for scores between the outputs of ``pairs`` (float32
    outputs, bf16-autocast outputs).

    clip: a cosine in [−1, 1] of two embeddings whose coordinates are each a few bf16 roundings
    from float32 (checked below: within 8u of the largest); their errors do not line up, and 4u =
    2^-6 ≈ 0.016 covers it (measured 0.004–0.006 on this model over three seeds).
    nclip: S = Σ_k p_k log q_k (each direction of −L_CE), with δ the largest logit error, bounded
    to first order: the change through q is Σ p_k Δlog q_k ≤ 2δ (log-softmax moves by
    Δz_k − E_q[Δz]); through p it is Σ Δp_k (log q_k − c) ≤ ‖Δp‖₁ · R/2 ≤ δ·R for the mid-range c
    (Σ Δp = 0, ‖Δp‖₁ ≤ 2δ), R the largest range of a row of logits; 25 % on top for the
    second-order terms. A worst case: the measured change is ~100× smaller."""
    delta = max((b[k]["nclip"] - a[k]["nclip"]).abs().max().item() for a, b in pairs for k in a)
    spread = max((a[k]["nclip"].amax(1) - a[k]["nclip"].amin(1)).max().item() for a, _ in pairs for k in a)
    return {"clip": 4 * U, "nclip": 1.25 * delta * (2 + spread)}


def _unstable(s32: torch.Tensor, s16: torch.Tensor, tol: float, k: int) -> torch.Tensor:
    """Rows whose top-k columns may differ between the two paths: a row's top-k set can change
    only where float32's k-th and (k+1)-th scores are closer than 2·tol (checked)."""
    top = s32.topk(min(k + 1, s32.shape[1]), dim=1).values
    margin = top[:, k - 1] - top[:, k] if top.shape[1] > k else torch.full((s32.shape[0],), float("inf"))
    changed = (s32.topk(k, dim=1).indices.sort(1).values != s16.topk(k, dim=1).indices.sort(1).values).any(1)
    assert (margin[changed] < 2 * tol).all(), "a top-k set changed beyond the rounding bound"
    return margin < 2 * tol


def test_bf16_autocast_scores_match_float32_within_the_rounding_bound():
    cfg, model, data = _model_and_data()
    f32, f16 = (extract(model, data, cfg.data.image_size, "cpu", 32, autocast=a) for a in (None, torch.bfloat16))
    outs = ({"image": f32.image, "text": f32.text}, {"image": f16.image, "text": f16.text})
    for side in outs[0]:
        for key, x in outs[0][side].items():
            y = outs[1][side][key]
            assert y.dtype == torch.float32, (side, key)  # the scores see float32 outputs
            assert 0 < (y - x).abs().max() <= 8 * U * x.abs().max(), (side, key)  # bf16 ran; measured ≤ 3u
    tol = _tolerances(outs)
    for head in ("clip", "nclip"):
        s32, s16 = (similarity(f.image, f.text, score_named(head)) for f in (f32, f16))
        assert (s16 - s32).abs().max() <= tol[head], head
        r32, r16 = (retrieval.evaluate(s, f32.text_to_image, ks=(1, 5)) for s in (s32, s16))
        for k in (1, 5):  # recall@k changes only through rows whose top-k set may change
            i2t, t2i = _unstable(s32, s16, tol[head], k), _unstable(s32.T, s16.T, tol[head], k)
            assert abs(r16[f"i2t@{k}"] - r32[f"i2t@{k}"]) <= i2t.float().mean() + 1e-9, (head, k)
            assert abs(r16[f"t2i@{k}"] - r32[f"t2i@{k}"]) <= t2i.float().mean() + 1e-9, (head, k)
    for kind, space in data.label_kinds.items():
        def classes(score):
            return [class_text_outputs(model, space, "cpu", score, a) for a in (None, torch.bfloat16)]

        nclip32, nclip16 = classes(score_named("nclip"))
        ztol = _tolerances(outs, ({"classes": nclip32}, {"classes": nclip16}))
        for head in ("clip", "nclip"):
            score = score_named(head)
            z32, z16 = (zeroshot.scores(f.image, c, score) for f, c in zip((f32, f16), classes(score)))
            assert (z16 - z32).abs().max() <= ztol[head], (head, kind)
            unstable = _unstable(z32, z16, ztol[head], 1)
            top1 = [zeroshot.evaluate(z, f32.labels[kind])[0]["top1"] for z in (z32, z16)]
            assert abs(top1[1] - top1[0]) <= unstable.float().mean() + 1e-9, (head, kind)


@pytest.fixture
def encodings(monkeypatch):
    """The autocast dtype (None: off) each image and text encoding of a DualEncoder ran under."""
    seen = []
    for name in ("encode_image", "encode_text"):
        real = getattr(DualEncoder, name)

        def recording(self, *args, _real=real, **kwargs):
            seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(DualEncoder, name, recording)
    return seen


@pytest.mark.parametrize("precision, want", [("bf16", torch.bfloat16), ("auto", None), ("fp32", None)])
def test_end_of_run_and_periodic_evaluation_follow_train_precision(encodings, precision, want):
    from nclip.eval.quick import evaluate_run
    from nclip.train.periodic_eval import PeriodicEval, build_sets

    cfg, model, _ = _model_and_data(f"train.precision={precision}", "eval.samples=16", "train.eval_samples=10")
    results = evaluate_run(model, cfg, torch.device("cpu"))
    assert 0 <= results["retrieval/i2t@1"] <= 1
    PeriodicEval(cfg, torch.device("cpu"), build_sets(cfg)).evaluate(model)
    assert encodings and set(encodings) == {want}


@pytest.mark.slow
def test_nclip_eval_follows_the_checkpoints_precision(encodings, tmp_path, capsys):
    from nclip.models.io import save_model

    cfg, model, _ = _model_and_data("train.precision=bf16")
    save_model(model, cfg, tmp_path / "model")
    out = tmp_path / "eval"
    argv = ["eval", "--checkpoint", str(tmp_path / "model"), "--out", str(out), "--tasks", "zeroshot,retrieval",
            "--dataset", "synthetic", "--samples", "16", "--no-report", "--quiet", "--device", "cpu"]
    assert main([*argv, "--cache-dir", str(tmp_path / "cache")]) == 0, capsys.readouterr().err
    assert encodings and set(encodings) == {torch.bfloat16}
    assert "zeroshot/synthetic-shape/top1" in json.loads((out / "results.json").read_text())["results"]
