"""`nclip.load`: the OpenCLIP-style Python API gives the evaluation's own features and zero-shot
predictions, with the objective's zero-shot head (CLIP cosine, nCLIP's −L_CE), and refuses text
calls on image-only objectives in one line."""

import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import nclip
from nclip.cli import main
from nclip.config import resolve
from nclip.data.transforms import eval_tensor
from nclip.errors import NclipError
from nclip.eval import zeroshot
from nclip.eval.features import encode_images, encode_texts
from nclip.models import build_model
from nclip.models.io import save_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

CAPTIONS = ["a red star", "two blue circles left of a green square", "x"]


def _images(n=4, seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(16, 16), (24, 24), (30, 20), (20, 33)]
    return [Image.fromarray(rng.integers(0, 256, (*shapes[i % 4], 3), dtype=np.uint8)) for i in range(n)]


def _model_dir(tmp_path, micro_overrides, objective, *extra):
    """A run's model directory with random weights moved off their initial values."""
    cfg = resolve("micro", micro_overrides + [f"objective.name={objective}", *extra])
    torch.manual_seed(0)
    model = build_model(cfg, pretrained_text=False).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return save_model(model, cfg, tmp_path / objective / "run" / "model")


def test_import_nclip_does_not_import_torch():
    code = "import sys, nclip; assert callable(nclip.load); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_load_encodes_as_the_evaluation_does(tmp_path, micro_overrides):
    model_dir = _model_dir(tmp_path, micro_overrides, "xclip")
    model = nclip.load(model_dir.parent, device="cpu")  # a run directory
    assert not model.training and model.head == "clip"
    images = _images()
    arrays = [np.asarray(im) for im in images]

    ref_img = encode_images(model.model, arrays, 16, "cpu")
    ref_txt = encode_texts(model.model, CAPTIONS, "cpu")
    emb_i, emb_t = model.encode_image(images), model.encode_text(CAPTIONS)
    torch.testing.assert_close(emb_i, F.normalize(ref_img["clip"], dim=-1))
    torch.testing.assert_close(emb_t, F.normalize(ref_txt["clip"], dim=-1))
    torch.testing.assert_close(emb_i.norm(dim=-1), torch.ones(4))

    # prepared inputs: transform's pixels, the tokenizer's (ids, mask), ids alone
    torch.testing.assert_close(model.transform(images[2]), eval_tensor(arrays[2], 16))
    pixels = torch.stack([model.transform(im) for im in images])
    torch.testing.assert_close(model.encode_image(pixels), emb_i)
    ids, mask = model.tokenizer(CAPTIONS)
    torch.testing.assert_close(model.encode_text((ids, mask)), emb_t)
    torch.testing.assert_close(model.encode_text(ids), emb_t)
    torch.testing.assert_close(model.similarity(emb_i, emb_t), emb_i @ emb_t.T)

    # a model directory and a weights file load the same model
    for path in (model_dir, model_dir / "model.safetensors"):
        torch.testing.assert_close(nclip.load(path, device="cpu").encode_image(images[:1]), emb_i[:1])


def test_zero_shot_with_nclip_head_is_symmetrised_minus_cross_entropy(tmp_path, micro_overrides):
    model = nclip.load(_model_dir(tmp_path, micro_overrides, "nclip"), device="cpu")
    assert model.head == "nclip"
    images, names = _images(3), ["star", "circle"]
    scores = model.zero_shot(images, names, templates=["a picture of a {}."])

    # by hand: p = softmax(h_image), q = softmax(h_class); −L_CE = (Σ p log q + Σ q log p) / 2 (Eq. 2)
    h_img = model.encode_image(images)  # the nCLIP head's logits, not normalised
    h_cls = model.encode_text([f"a picture of a {n}." for n in names])
    logp, logq = h_img.log_softmax(-1), h_cls.log_softmax(-1)
    expected = (logp.exp() @ logq.T + logp @ logq.exp().T) / 2
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)
    cosine = F.normalize(h_img, dim=-1) @ F.normalize(h_cls, dim=-1).T
    assert not torch.allclose(scores, cosine)
    torch.testing.assert_close(model.similarity(h_img, h_cls), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("objective", ["cmsf", "supcon"])
def test_image_only_objectives_refuse_text_calls(tmp_path, micro_overrides, objective):
    model = nclip.load(_model_dir(tmp_path, micro_overrides, objective, "data.source=digits"), device="cpu")
    emb = model.encode_image(_images(2))
    assert emb.shape[0] == 2 and torch.allclose(emb.norm(dim=-1), torch.ones(2))
    for call in (lambda: model.encode_text(CAPTIONS), lambda: model.zero_shot(_images(1), ["a", "b"])):
        with pytest.raises(NclipError, match="trains no text-aligned head") as err:
            call()
        assert "\n" not in str(err.value)


def test_load_errors_are_one_line(tmp_path):
    with pytest.raises(NclipError, match="no nclip checkpoint"):
        nclip.load(tmp_path)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, one_thread):
    from nclip.train.loop import train

    from conftest import MICRO_OVERRIDES

    run = tmp_path_factory.mktemp("api") / "run"
    train(resolve("micro", [*MICRO_OVERRIDES, "train.steps=4", "train.checkpoint_every=4"]), run,
          progress=False, evaluate=False)
    return run


def _class_folders(root, rng):
    for split, n in (("train", 2), ("test", 4)):
        for c, name in enumerate(["red_thing", "green_thing", "blue_thing"]):
            for i in range(n):
                img = rng.integers(0, 60, (24, 20 + 4 * i, 3), dtype=np.uint8)
                img[..., c] += 180
                path = root / split / name / f"{i}.png"
                path.parent.mkdir(parents=True, exist_ok=True)
                Image.fromarray(img).save(path)


@pytest.mark.slow
def test_zero_shot_agrees_with_nclip_eval(trained_run, tmp_path, monkeypatch):
    root = tmp_path / "pics"
    _class_folders(root, np.random.default_rng(1))
    seen = []

    def spy(class_scores, labels):
        seen.append(class_scores)
        return evaluate(class_scores, labels)

    evaluate = zeroshot.evaluate
    monkeypatch.setattr(zeroshot, "evaluate", spy)
    assert main(["eval", "--checkpoint", str(trained_run), "--dataset", f"folder:{root}", "--tasks", "zeroshot",
                 "--out", str(tmp_path / "eval"), "--no-report", "--no-cache", "--quiet"]) == 0
    (eval_scores,) = seen

    model = nclip.load(trained_run / "checkpoints" / "step_00000004", device="cpu")  # a training checkpoint
    test_images = [Image.open(p) for c in ("blue_thing", "green_thing", "red_thing")
                   for p in sorted((root / "test" / c).iterdir())]  # the eval's order: sorted classes
    scores = model.zero_shot(test_images, ["blue thing", "green thing", "red thing"])
    torch.testing.assert_close(scores, eval_scores, rtol=1e-5, atol=1e-6)
    assert torch.equal(scores.argmax(1), eval_scores.argmax(1))
