"""`nclip export --onnx`: image and text encoders under onnxruntime give nclip.load's embeddings;
the export command's one-line errors, its --force and its atomic folder (every format's)."""

from __future__ import annotations

import errno
import json
import os
import sys

import numpy as np
import pytest
import torch

import nclip
from nclip.cli import main
from nclip.config import resolve
from nclip.data.tokenization import CaptionTokenizer, bundled_model_dir
from nclip.data.transforms import CLIP_MEAN, CLIP_STD
from nclip.models import build_model
from nclip.models.export_onnx import embedding_space
from nclip.models.io import save_model

ort = pytest.importorskip("onnxruntime")

CAPTIONS = ["a red star", "two blue circles left of a green square " * 4, "x", "", "Ünïcödé ☃", "a b c"]
CASES = {
    "xclip-clip-head": [],  # the micro preset: CLIP and nCLIP heads, zero-shot by the CLIP head
    "nclip-logits": ["objective.name=nclip"],
    "clip_resnet-minilm": ['model.vision={"kind": "clip_resnet", "embedding_size": 8, "depths": [1, 1, 1, 1], '
                           '"hidden_sizes": [32, 64, 128, 256], "heads": 4}', "data.image_size=32",
                           "model.text.kind=pretrained", "objective.name=clip"],
    "convnet": ['model.vision={"kind": "convnet", "embedding_size": 8, "depths": [1, 1], "hidden_sizes": [16, 32], '
                '"heads": 2}', "objective.name=clip"],
    "cmsf-image-only": ["objective.name=cmsf", "model.cmsf_hidden=64", "model.cmsf_dim=32"],
    # a lone tokenizer.json (no tokenizer_config.json beside it): the export writes the config AutoTokenizer needs
    "tokenizer-file": [f"model.text.tokenizer={bundled_model_dir() / 'tokenizer.json'}", "objective.name=clip"],
}


def saved(tmp_path, overrides, seed=0):
    cfg = resolve("micro", overrides)
    torch.manual_seed(seed)
    model = build_model(cfg, pretrained_text=False).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    save_model(model, cfg, tmp_path / "run" / "model")
    return tmp_path / "run"


def export(run, out, *extra) -> int:
    return main(["export", "--checkpoint", str(run), "--onnx", str(out), *extra])


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


SLOW = {"clip_resnet-minilm"}  # MiniLM's 22M parameters: ~15 s to save, trace and load


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in CASES])
def test_onnxruntime_gives_nclip_loads_embeddings(tmp_path, micro_overrides, name):
    run = saved(tmp_path, micro_overrides + CASES[name])
    assert export(run, tmp_path / "onnx") == 0
    ours = nclip.load(run, device="cpu")
    config = json.loads((tmp_path / "onnx" / "onnx_config.json").read_text())
    size = config["image"]["size"]
    assert size == ours.image_size
    # float32 from the JSON numbers: CLIP's statistics exactly, as the transform uses them
    assert np.array_equal(np.float32(config["image"]["mean"]), CLIP_MEAN)
    assert np.array_equal(np.float32(config["image"]["std"]), CLIP_STD)
    assert config["embedding"]["score"] == ours.head
    assert config["image_encoder"]["outputs"]["embedding"]["l2_normalised"] == (ours.head in ("clip", None))
    image = ort.InferenceSession(str(tmp_path / "onnx" / config["image_encoder"]["file"]))
    assert [i.name for i in image.get_inputs()] == list(config["image_encoder"]["inputs"]) == ["pixels"]
    if ours.head is None:  # an image-only objective: no text embedding to export
        assert config["text_encoder"] is None and not (tmp_path / "onnx" / "text_encoder.onnx").exists()
    else:
        text = ort.InferenceSession(str(tmp_path / "onnx" / config["text_encoder"]["file"]))
        assert [i.name for i in text.get_inputs()] == list(config["text_encoder"]["inputs"]) == ["input_ids",
                                                                                                  "attention_mask"]
    # the tokenizer beside the graphs gives nclip's ids and mask, read by nclip, tokenizers or transformers
    tokenizer_dir = tmp_path / "onnx" / config["tokenizer"]["path"]
    tok = CaptionTokenizer(config["tokenizer"]["text_length"], tokenizer_dir)
    deployed = deployed_tokenizers(tokenizer_dir)
    torch.manual_seed(1)
    for batch in (1, 5):  # neither is the traced batch size (2)
        pixels = torch.randn(batch, 3, size, size)
        got = image.run(None, {"pixels": pixels.numpy()})[0]
        np.testing.assert_allclose(got, ours.encode_image(pixels).numpy(), rtol=0, atol=1e-4)
        if ours.head is None:
            continue
        ids, mask = tok(CAPTIONS[:batch])
        want_ids, want_mask = ours.tokenizer(CAPTIONS[:batch])
        assert torch.equal(ids, want_ids) and torch.equal(mask, want_mask)
        for encode in deployed:
            got_ids, got_mask = encode(CAPTIONS[:batch])
            assert np.array_equal(got_ids, want_ids.numpy()) and np.array_equal(got_mask, want_mask.numpy()), encode
        got = text.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
        np.testing.assert_allclose(got, ours.encode_text(CAPTIONS[:batch]).numpy(), rtol=0, atol=1e-4)


def deployed_tokenizers(directory):
    """The export's tokenizer as a deployment without nclip reads it: tokenizers' Tokenizer.from_file
    of its tokenizer.json as it is, and AutoTokenizer padding and truncating to its model_max_length;
    each as texts -> (ids, mask) int64 arrays."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    plain = Tokenizer.from_file(str(directory / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(str(directory))

    def with_tokenizers(texts):
        enc = plain.encode_batch(texts)
        return np.array([e.ids for e in enc], np.int64), np.array([e.attention_mask for e in enc], np.int64)

    def with_transformers(texts):
        enc = auto(texts, padding="max_length", truncation=True, return_tensors="np")
        return enc["input_ids"], enc["attention_mask"]

    return with_tokenizers, with_transformers


def test_an_image_only_objective_has_no_text_embedding():
    cfg = resolve("micro", ["objective.name=cmsf"])
    score, key, normalise = embedding_space(cfg)
    assert score is None and key in ("features", "clip", "cmsf") and normalise
    score, key, normalise = embedding_space(resolve("micro", ["objective.name=yclip"]))
    assert (score.name, key, normalise) == ("yclip", "nclip", False)


def test_a_missing_onnx_package_is_one_line(tmp_path, micro_overrides, monkeypatch, capsys):
    run = saved(tmp_path, micro_overrides)
    monkeypatch.setitem(sys.modules, "onnx", None)  # import onnx raises ImportError
    assert export(run, tmp_path / "onnx") == 2
    assert "pip install 'nclip[onnx]'" in one_line(capsys)
    assert not (tmp_path / "onnx").exists()


@pytest.mark.parametrize("argv, says", [
    ([], "one of the arguments --hf --open-clip --onnx is required"),
    (["--hf", "A", "--onnx", "B"], "not allowed with argument"),
    (["--onnx", "B"], "no nclip model found"),
    (["--open-clip", "B"], "no nclip model found"),
])
def test_exactly_one_format(tmp_path, capsys, argv, says):
    assert main(["export", "--checkpoint", str(tmp_path), *argv]) == 2
    assert says in one_line(capsys)


def test_a_non_empty_folder_needs_force_and_is_then_replaced_whole(tmp_path, micro_overrides, capsys):
    run = saved(tmp_path, micro_overrides)
    out = tmp_path / "onnx"
    out.mkdir()
    (out / "old.txt").write_text("an older export\n")
    assert export(run, out) == 2
    assert one_line(capsys).endswith(f"--onnx {out} already exists and is not empty; choose a new directory, "
                                     "or pass --force to write over it")
    assert export(run, out, "--force") == 0
    assert sorted(p.name for p in out.iterdir()) == ["image_encoder.onnx", "nclip_export.json", "onnx_config.json",
                                                     "text_encoder.onnx", "tokenizer"]  # the old file, the lock: gone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["onnx", "run"]  # no temporary folder left


def test_a_failed_export_leaves_the_folder_as_it_was(tmp_path, micro_overrides, monkeypatch, capsys):
    import nclip.models.export_onnx as export_onnx

    run = saved(tmp_path, micro_overrides)
    out = tmp_path / "onnx"
    out.mkdir()
    (out / "old.txt").write_text("an older export\n")

    def full(module, args, names, path):
        path.write_bytes(b"half a graph")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(export_onnx, "_export", full)
    assert export(run, out, "--force") == 2
    assert one_line(capsys) == f"nclip: error: cannot write {out}: No space left on device"
    assert sorted(p.name for p in out.iterdir()) == ["old.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["onnx", "run"]


def test_the_lock_is_held_across_the_rename(tmp_path):
    """atomic_export renames a new folder over OUT: the lock file nclip export holds comes along (a
    hard link of the locked file), so a second export is still refused until the first ends."""
    from nclip.errors import NclipError
    from nclip.models.export_base import atomic_export
    from nclip.runlock import LOCK_NAME, DirLock

    out = tmp_path / "out"
    with DirLock(out, "nclip export", "--onnx") as lock:
        with atomic_export(out, "onnx") as tmp:
            (tmp / "a.txt").write_text("a\n")
        assert os.fstat(lock.fd).st_ino == os.stat(out / LOCK_NAME).st_ino
        with pytest.raises(NclipError, match="in use by another nclip process"):
            DirLock(out, "nclip export", "--onnx").acquire()
    assert sorted(p.name for p in out.iterdir()) == ["a.txt", "nclip_export.json"]


def test_export_into_the_run_is_refused(tmp_path, micro_overrides, capsys):
    run = saved(tmp_path, micro_overrides)
    assert main(["export", "--checkpoint", str(run), "--open-clip", str(run / "model"), "--force"]) == 2
    assert one_line(capsys).startswith(f"nclip: error: --open-clip {run / 'model'} is a model; nclip export --force "
                                       "replaces only an earlier export")


# the docs' example images, as it names them: non-square and whose centre crops' overhangs are 3 (mod 4) at
# the micro image size S = 16 (34x20 -> 27x16, 21x41 -> 16x31, 23x16 as it is), where torchvision's and
# transformers' crops are 1 px apart; an RGB JPEG, an RGBA PNG, a P PNG with a transparency colour
SNIPPET_IMAGES = {"photo.jpg": ("RGB", (34, 20)), "logo.png": ("RGBA", (21, 41)), "icon.png": ("P", (23, 16))}
PREPROCESSING = {
    "torchvision": [],  # nclip's own models: round the crop, to RGB after it
    "transformers": ["data.eval_convention=transformers"],  # to RGB (on white) first, floor the crop
    "squash-bilinear": ["data.eval_resize=squash", "data.eval_interpolation=bilinear"],
}
# what the snippet must run without: a deployment with only PIL, numpy, tokenizers and onnxruntime
NOT_DEPLOYED = ("nclip", "torch", "transformers")
HARNESS = f"""
import sys


class NotDeployed:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {NOT_DEPLOYED!r}:
            raise ImportError(f"{{name}} is not installed where the ONNX export is deployed")


sys.meta_path.insert(0, NotDeployed())
"""
CHECK = f"""
np.savez("snippet.npz", img=img, txt=txt, pixels=np.stack([pixels(i) for i in images]))
json.dump(captions, open("captions.json", "w"))
assert not [m for m in sys.modules if m.split(".")[0] in {NOT_DEPLOYED!r}], sorted(sys.modules)
"""


def snippet_images(directory):
    """The files the docs' snippet opens, written into ``directory``."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for name, (mode, (w, h)) in SNIPPET_IMAGES.items():
        image = Image.fromarray(rng.integers(0, 256, (h, w, 4 if mode == "RGBA" else 3), dtype=np.uint8))
        if mode == "P":
            image = image.quantize(16)
            image.info["transparency"] = 3
        image.save(directory / name, **({"transparency": 3} if mode == "P" else {}))


@pytest.mark.parametrize("preprocessing", PREPROCESSING)
def test_the_docs_onnxruntime_snippet_needs_no_nclip_and_gives_nclip_loads_embeddings(
        tmp_path, micro_overrides, capsys, preprocessing):
    """docs/export.md's ONNX snippet, run as written in a fresh interpreter where nclip, torch and
    transformers cannot be imported: its pixels are nclip.load's bit for bit, for each crop rounding,
    conversion to RGB and resize that onnx_config.json can name, and its embeddings equal
    encode_image / encode_text to 1e-5."""
    import re
    import subprocess
    from pathlib import Path

    from PIL import Image

    docs = (Path(__file__).resolve().parents[2] / "docs" / "export.md").read_text()
    snippet = next(b for b in re.findall(r"```python\n(.*?)```", docs, flags=re.S) if "onnxruntime" in b)
    assert all(name in snippet for name in SNIPPET_IMAGES)
    run = saved(tmp_path, micro_overrides + PREPROCESSING[preprocessing])
    assert export(run, tmp_path / "runs" / "micro-onnx") == 0
    snippet_images(tmp_path)
    done = subprocess.run([sys.executable, "-I", "-c", HARNESS + snippet + CHECK], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("[[")  # the printed cosines

    ours = nclip.load(run, device="cpu")
    images = [Image.open(tmp_path / name) for name in SNIPPET_IMAGES]
    assert [im.mode for im in images] == [mode for mode, _ in SNIPPET_IMAGES.values()]
    got = np.load(tmp_path / "snippet.npz")
    assert np.array_equal(got["pixels"], torch.stack([ours.transform(im) for im in images]).numpy())
    np.testing.assert_allclose(got["img"], ours.encode_image(images).numpy(), rtol=0, atol=1e-5)
    captions = json.loads((tmp_path / "captions.json").read_text())
    np.testing.assert_allclose(got["txt"], ours.encode_text(captions).numpy(), rtol=0, atol=1e-5)
