"""CMSF's cross-modal constraint end to end (Sec. 2.3): the frozen embedding of every training sample
(bundled MiniLM on the captions, or a frozen nclip checkpoint's text or image tower), the batches'
dataset indices, and training through the CLI on built-in data and on a CSV without labels."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from nclip.cli import main
from nclip.config import resolve
from nclip.data.loader import train_loader
from nclip.data.sources import build_dataset
from nclip.errors import NclipError
from nclip.objectives.base import FrozenEmbedding
from nclip.train.frozen_embedding import frozen_table

from conftest import micro_sizes

QUIET = ["--no-progress", "--no-eval"]
XMODAL = ["objective.name=cmsf", "objective.constraint=cross_modal", "objective.k=3", "objective.k_prime=6",
          "objective.bank_size=32", "model.cmsf_hidden=32", "model.cmsf_dim=16", "train.batch_size=8",
          "train.threads=1", "train.log_every=1"]


def _sets(overrides):
    return [a for o in overrides for a in ("--set", o)]


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def micro_run(tmp_path_factory):
    """A two-step xCLIP micro run: a frozen nclip checkpoint with a text and an image tower."""
    out = tmp_path_factory.mktemp("frozen") / "run"
    assert main(["train", "--preset", "micro", "--out", str(out), *QUIET,
                 *_sets(["train.steps=2", "data.train_length=40"])]) == 0
    return out


def test_nclip_checkpoint_embeds_every_training_sample(micro_run):
    from nclip.eval.features import encode_images, encode_texts
    from nclip.models.io import load_model

    cfg = resolve("micro", ["data.train_length=40"])
    model, _ = load_model(micro_run / "model")
    samples = build_dataset(cfg, "train")
    text = frozen_table(cfg, FrozenEmbedding(str(micro_run), "text"))
    image = frozen_table(cfg, FrozenEmbedding(str(micro_run / "model"), "image"))
    assert text.shape == image.shape == (40, cfg.model.embed_dim)
    torch.testing.assert_close(text, encode_texts(model, [s.caption for s in samples], "cpu")["clip"])
    torch.testing.assert_close(image, encode_images(model, [s.image for s in samples], 16, "cpu")["clip"])


@pytest.mark.parametrize("spec,match", [
    (FrozenEmbedding("/nonexistent/encoder"), "does not exist"),
    (FrozenEmbedding(None, "image"), "image frozen embedding needs an nclip run or model directory"),
])
def test_bad_frozen_encoder_is_one_line(spec, match):
    with pytest.raises(NclipError, match=match) as e:
        frozen_table(resolve("micro", ["data.train_length=40"]), spec)
    assert "\n" not in str(e.value)


def test_batches_carry_the_dataset_indices(micro_run):
    from nclip.objectives import REGISTRY

    cfg = resolve("micro", micro_sizes() + XMODAL + ["data.train_length=40", "train.steps=3"])
    request = REGISTRY["cmsf"][1].label_request(cfg)
    assert request.frozen == FrozenEmbedding(None, "text") and request.optional
    data = train_loader(cfg, _tokenizer(micro_run), views=2, labels=request)
    samples = build_dataset(cfg, "train")
    for step, batch in enumerate(data):
        assert batch.pixels.shape[:2] == (8, 2) and batch.index.dtype == torch.long
        expected = np.asarray(data.loader.batch_sampler.global_batch(step))
        assert batch.index.tolist() == expected.tolist()
        assert batch.true_labels.tolist() == [samples[i].labels["shape"] for i in expected]


def _tokenizer(run):
    from nclip.models.io import load_model

    return load_model(run / "model")[0].tokenizer


@pytest.mark.slow
def test_cross_modal_trains_on_built_in_data_with_purity(tmp_path, micro_run):
    out = tmp_path / "xm"
    args = ["train", "--preset", "micro", "--out", str(out), *QUIET,
            *_sets(micro_sizes() + XMODAL + ["data.train_length=40", "train.steps=6",
                                            f"objective.constraint_encoder={micro_run}"])]
    assert main(args) == 0
    rows = _rows(out)
    assert len(rows) == 6 and all(np.isfinite(r["loss"]) for r in rows)
    # the search is restricted to the k' = 6 frozen neighbours (the batch alone has 8 candidates)
    assert all(r["cmsf/constrained_size"] <= 6 for r in rows) and rows[-1]["cmsf/neighbours"] == 3
    assert "cmsf/purity" in rows[-1]


@pytest.mark.slow
def test_cross_modal_trains_on_a_csv_without_labels(tmp_path, monkeypatch):
    from PIL import Image

    monkeypatch.setenv("NCLIP_CACHE", str(tmp_path / "cache"))  # the MiniLM caption features

    rng = np.random.default_rng(0)
    (tmp_path / "img").mkdir()
    lines = ["filepath,title"]
    for i in range(24):
        Image.fromarray(rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)).save(tmp_path / "img" / f"{i}.png")
        lines.append(f"img/{i}.png,a {'red' if i % 2 else 'blue'} picture number {i % 3}")
    (tmp_path / "pairs.csv").write_text("\n".join(lines) + "\n")
    out = tmp_path / "xm"
    args = ["train", "--preset", "micro", "--out", str(out), *QUIET,
            *_sets(micro_sizes() + XMODAL + ["data.source=csv", f"data.csv={tmp_path / 'pairs.csv'}",
                                            "train.steps=4"])]
    assert main(args) == 0
    rows = _rows(out)
    assert len(rows) == 4 and "cmsf/purity" not in rows[-1]  # no labels: no purity
    # repeated captions tie in the frozen embedding: u itself is added when the tie-break left it out
    assert all(r["cmsf/constrained_size"] <= 7 for r in rows)
    assert len(list((tmp_path / "cache" / "teacher").glob("*.safetensors"))) == 1
