"""`nclip eval --checkpoint` of a transformers CLIPModel directory (a model nclip did not train): the
zero-shot predictions are the ones the CLIPModel itself gives, and it serves as --baseline."""

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent.parent / "models"))
from hf_fixtures import IMAGE_SIZE, features, hf_pixels, save_tiny_clip  # noqa: E402

from nclip.cli import main  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _clipmodel_scores(hf, directory: Path, seed: int) -> torch.Tensor:
    """[N, 10] zero-shot digit scores computed with the CLIPModel and its own tokenizer alone: CLIP's
    prompt ensemble (normalised prompt embeddings averaged per class, renormalised), cosine."""
    from transformers import AutoTokenizer

    from nclip.data.digits import DigitsPairs
    from nclip.data.transforms import CLIP_MEAN, CLIP_STD, eval_tensor

    tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    test = DigitsPairs("test", seed=seed, image_size=IMAGE_SIZE, val_fraction=0.0)
    space = test.label_kinds["digit"]
    images = torch.stack([eval_tensor(test[i].image, IMAGE_SIZE) for i in range(len(test))])
    raw = images * torch.from_numpy(CLIP_STD).view(1, 3, 1, 1) + torch.from_numpy(CLIP_MEAN).view(1, 3, 1, 1)
    with torch.no_grad():
        img = F.normalize(features(hf.get_image_features(pixel_values=hf_pixels(raw))), dim=-1)
        classes = []
        for c in range(len(space)):
            enc = tok(space.prompts(c), padding="max_length", max_length=16, truncation=True, return_tensors="pt")
            emb = F.normalize(features(hf.get_text_features(**enc)), dim=-1).mean(0)
            classes.append(F.normalize(emb, dim=-1))
    return img @ torch.stack(classes).T


def test_eval_of_a_clipmodel_directory_matches_the_clipmodel(tmp_path, monkeypatch):
    from nclip.eval import zeroshot

    hf = save_tiny_clip(tmp_path / "clip", legacy_eos=True, seed=2)
    seen = []
    evaluate = zeroshot.evaluate
    monkeypatch.setattr(zeroshot, "evaluate", lambda scores, labels: seen.append(scores) or evaluate(scores, labels))
    out = tmp_path / "eval"
    assert main(["eval", "--checkpoint", str(tmp_path / "clip"), "--out", str(out), "--tasks", "zeroshot",
                 "--dataset", "digits", "--no-report", "--no-cache", "--quiet", "--seed", "3"]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["checkpoint"]["format"] == "transformers CLIPModel" and doc["checkpoint"]["objective"] == "clip"
    assert doc["checkpoint"]["image_size"] == IMAGE_SIZE and doc["checkpoint"]["head"] == "clip"
    want = _clipmodel_scores(hf, tmp_path / "clip", seed=3)
    assert len(seen) == 1 and want.argmax(1).unique().numel() > 1  # not one class for every image
    torch.testing.assert_close(seen[0], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(seen[0].argmax(1), want.argmax(1))


def test_a_clipmodel_directory_serves_as_baseline(tmp_path):
    save_tiny_clip(tmp_path / "clip")
    realms = tmp_path / "realms"
    for realm in ("photo", "sketch"):
        for c, colour in enumerate([(200, 30, 30), (30, 30, 200)]):
            folder = realms / realm / ("red" if c == 0 else "blue")
            folder.mkdir(parents=True)
            for i in range(6):
                Image.new("RGB", (20, 20), tuple(v + 5 * i for v in colour)).save(folder / f"{i}.png")
    out = tmp_path / "eval"
    assert main(["eval", "--checkpoint", str(tmp_path / "clip"), "--out", str(out), "--tasks", "realms",
                 "--dataset", f"realms:{realms}", "--baseline", str(tmp_path / "clip"), "--no-report",
                 "--no-cache", "--quiet"]) == 0
    doc = json.loads((out / "results.json").read_text())
    relative = [k for k in doc["results"] if k.startswith("realms/") and "relative" in k]
    assert relative and all(doc["results"][k] == pytest.approx(0.0, abs=1e-9) for k in relative)
