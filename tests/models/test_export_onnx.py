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
from nclip.data.tokenization import CaptionTokenizer
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
    np.testing.assert_allclose(config["image"]["mean"], CLIP_MEAN, rtol=1e-7)
    np.testing.assert_allclose(config["image"]["std"], CLIP_STD, rtol=1e-7)
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
    # the tokenizer beside the graphs gives nclip's ids and mask
    tok = CaptionTokenizer(config["tokenizer"]["text_length"], tmp_path / "onnx" / config["tokenizer"]["path"])
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
        got = text.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
        np.testing.assert_allclose(got, ours.encode_text(CAPTIONS[:batch]).numpy(), rtol=0, atol=1e-4)


def test_an_image_only_objective_has_no_text_embedding():
    cfg = resolve("micro", ["objective.name=cmsf"])
    score, key, normalise = embedding_space(cfg)
    assert score is None and key in ("features", "clip", "cmsf") and normalise
    assert embedding_space(resolve("micro", ["objective.name=yclip"])) == ("yclip", "nclip", False)


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
    from nclip.models.export import atomic_export
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


def test_the_docs_onnxruntime_snippet_runs_and_gives_nclip_loads_scores(tmp_path, micro_overrides, monkeypatch,
                                                                         capsys):
    import re
    from pathlib import Path

    from PIL import Image

    docs = (Path(__file__).resolve().parents[2] / "docs" / "export.md").read_text()
    snippet = next(b for b in re.findall(r"```python\n(.*?)```", docs, flags=re.S) if "onnxruntime" in b)
    run = saved(tmp_path, micro_overrides)
    assert export(run, tmp_path / "runs" / "micro-onnx") == 0
    capsys.readouterr()
    monkeypatch.chdir(tmp_path)
    names: dict = {}
    exec(snippet, names)  # the documentation's own code
    ours = nclip.load(run, device="cpu")
    want = ours.encode_image([Image.new("RGB", (64, 48), "red")]) @ ours.encode_text(["a red circle",
                                                                                       "a blue square"]).T
    np.testing.assert_allclose(names["img"] @ names["txt"].T, want.numpy(), rtol=0, atol=1e-5)
    assert capsys.readouterr().out.startswith("[[")
