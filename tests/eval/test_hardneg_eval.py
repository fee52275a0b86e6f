"""`nclip eval --dataset hardneg:FILE` (nclip.eval.hardneg): a caption against its hard negatives,
SugarCrepe / ARO style: the file's rows (CSV columns, JSONL lists, the training file as it is), the
accuracy against a direct count, the whole command through a saved model, and one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from nclip.cli import main
from nclip.config import resolve
from nclip.errors import NclipError
from nclip.eval import hardneg
from nclip.eval.datasets import build
from nclip.objectives.scores import score_named

from conftest import micro_sizes


def _images(root, n: int = 4) -> None:
    rng = np.random.default_rng(0)
    (root / "img").mkdir(exist_ok=True)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(root / "img" / f"{i}.png")


def _build(spec: str, run_keys=None):
    return build(spec, image_size=16, max_objects=2, seed=0, test_samples=10, train_samples=10, sts_pairs=0,
                 run_keys=run_keys)[0]


def test_rows_from_negative_columns_jsonl_lists_and_the_training_file(tmp_path):
    _images(tmp_path)
    (tmp_path / "set.csv").write_text("image,caption,negative_1,negative_2\nimg/0.png,a red dog,a dog red,\n"
                                      "img/0.png,a dog on grass,grass on a dog,a dog on sand\n")
    data = _build(f"hardneg:{tmp_path / 'set.csv'}")
    assert data.splits["test"].captions == [("a red dog",), ("a dog on grass",)] and not data.retrieval
    assert data.hard_negatives == [("a dog red",), ("grass on a dog", "a dog on sand")]
    rows = [{"image": "img/1.png", "caption": "x", "negatives": ["y", "z"]}, {"image": "img/2.png", "caption": "u",
                                                                             "negatives": "v"}]
    (tmp_path / "set.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert _build(f"hardneg:{tmp_path / 'set.jsonl'}").hard_negatives == [("y", "z"), ("v",)]
    (tmp_path / "train.csv").write_text("filepath,title,negs\nimg/3.png,p|q,n1|n2\n")
    keys = resolve("micro", ["data.source=csv", f"data.csv={tmp_path / 'train.csv'}", 'data.caption_separator="|"',
                             "data.hard_negative_key=negs", "objective.name=clip"]).data.caption_keys()
    data = _build(f"hardneg:{tmp_path / 'train.csv'}", keys)
    assert data.splits["test"].captions == [("p", "q")] and data.hard_negatives == [("n1", "n2")]
    # the run's column named like a file's own negative columns: still the run's, split by its separator
    (tmp_path / "train.csv").write_text("filepath,title,negatives\nimg/3.png,p|q,n1|n2\n")
    keys = resolve("micro", ["data.source=csv", f"data.csv={tmp_path / 'train.csv'}", 'data.caption_separator="|"',
                             "data.hard_negative_key=negatives", "objective.name=clip"]).data.caption_keys()
    assert _build(f"hardneg:{tmp_path / 'train.csv'}", keys).hard_negatives == [("n1", "n2")]


def test_a_training_jsonl_whose_captions_are_lists_evaluates_as_it_is(tmp_path):
    _images(tmp_path)
    rows = [{"filepath": "img/0.png", "captions": ["a red dog", "a dog, red"], "negatives": ["a dog red"]},
            {"filepath": "img/1.png", "captions": "a cat", "negatives": ["a tac", "no cat"]}]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    keys = resolve("micro", ["data.source=csv", f"data.csv={tmp_path / 'train.jsonl'}", "data.csv_caption_key=captions",
                             "data.hard_negative_key=negatives", "objective.name=clip"]).data.caption_keys()
    data = _build(f"hardneg:{tmp_path / 'train.jsonl'}", keys)
    assert data.splits["test"].captions == [("a red dog", "a dog, red"), ("a cat",)]
    assert data.hard_negatives == [("a dog red",), ("a tac", "no cat")]
    (tmp_path / "bad.jsonl").write_text(json.dumps({**rows[0], "captions": []}) + "\n")
    with pytest.raises(NclipError, match="bad.jsonl line 1: the caption list is empty"):
        _build(f"hardneg:{tmp_path / 'bad.jsonl'}", keys)


@pytest.mark.parametrize("content,needle", [
    ("image,caption\nimg/0.png,a\n", "set.csv line 1: the header needs an image column"),
    ("image,caption,negative\nimg/0.png,a,\n", "set.csv line 2: no negative caption"),
    ("image,caption,negative\nimg/0.png,,b\n", "set.csv line 2: no caption"),
    ("image,caption,negative\nimg/9.png,a,b\n", "set.csv line 2: image not found"),
])
def test_bad_rows_are_one_line_naming_the_file_and_line(tmp_path, content, needle):
    _images(tmp_path)
    (tmp_path / "set.csv").write_text(content)
    with pytest.raises(NclipError, match=needle):
        _build(f"hardneg:{tmp_path / 'set.csv'}")


def test_the_accuracy_counts_rows_whose_best_caption_beats_every_negative(monkeypatch):
    g = torch.Generator().manual_seed(0)
    rows, d = 7, 4
    image = torch.randn(rows, d, generator=g)
    text_to_image = torch.tensor([0, 1, 1, 2, 3, 4, 5, 6])
    text = torch.randn(len(text_to_image), d, generator=g)
    negative_to_row = torch.tensor([0, 0, 1, 2, 2, 2, 3, 4, 5, 6, 6])
    negatives = torch.randn(len(negative_to_row), d, generator=g)
    negatives[3] = text[3] * 2  # row 2: a negative on its caption's direction, a tie: wrong
    cos = torch.nn.functional.cosine_similarity
    want = 0
    for r in range(rows):
        best = max(float(cos(image[r], text[t], dim=0)) for t in range(len(text)) if text_to_image[t] == r)
        worst = max(float(cos(image[r], negatives[m], dim=0)) for m in range(len(negatives)) if negative_to_row[m] == r)
        want += best > worst
    monkeypatch.setattr(hardneg, "_CHUNK", 3)  # rows scored in chunks, their texts across chunk boundaries
    got = hardneg.evaluate(image, text, text_to_image, negatives, negative_to_row, score_named("clip"))
    assert got == {"hardneg_top1": pytest.approx(want / rows), "hardneg_rows": rows} and 0 < want < rows


@pytest.mark.slow
def test_nclip_eval_scores_a_hardneg_file_with_the_models_score(tmp_path, capsys):
    from nclip.eval.features import encode_images, encode_texts
    from nclip.models import build_model
    from nclip.models.io import load_model, save_model

    _images(tmp_path)
    lines = ["image,caption,negative_a,negative_b"] + [f"img/{i % 4}.png,photo {i} of a cat,photo {i} of a dog,"
                                                       f"a cat of photo {i}" for i in range(6)]
    (tmp_path / "set.csv").write_text("\n".join(lines) + "\n")
    cfg = resolve("micro", [*micro_sizes(), "objective.name=clip"])
    torch.manual_seed(0)
    path = save_model(build_model(cfg), cfg, tmp_path / "model")  # untrained: the count is what is checked
    assert main(["eval", "--checkpoint", str(path), "--out", str(tmp_path / "out"), "--quiet", "--no-cache",
                 "--no-report", "--dataset", f"hardneg:{tmp_path / 'set.csv'}", "--tasks", "retrieval"]) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())["results"]
    model, _ = load_model(path, "cpu")
    images = [np.asarray(Image.open(tmp_path / "img" / f"{i % 4}.png").convert("RGB")) for i in range(6)]
    u = torch.nn.functional.normalize(encode_images(model, images, 16, "cpu")["clip"], dim=-1)
    texts = [t for i in range(6) for t in (f"photo {i} of a cat", f"photo {i} of a dog", f"a cat of photo {i}")]
    v = torch.nn.functional.normalize(encode_texts(model, texts, "cpu")["clip"], dim=-1).reshape(6, 3, -1)
    s = (u[:, None, :] * v).sum(-1)
    want = float((s[:, 0] > s[:, 1:].max(1).values).float().mean())
    assert results["retrieval/set/hardneg_rows"] == 6
    assert results["retrieval/set/hardneg_top1"] == pytest.approx(want, abs=1e-6)
