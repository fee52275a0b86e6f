"""`nclip export --open-clip` writes open_clip's hub layout: nclip's own open_clip reader and, where it
is installed, open_clip itself give the exported model's embeddings."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import nclip
from nclip.cli import main
from nclip.config import resolve
from nclip.data import clip_bpe
from nclip.data.transforms import CLIP_MEAN, CLIP_STD
from nclip.models import build_model
from nclip.models.export_openclip import resnet_state
from nclip.models.io import save_model
from nclip.models.openclip_import import resnet_names

from openclip_refs import open_clip

CAPTIONS = ["a photo of a cat", "two dogs playing on the beach at sunset", "", "Ünïcödé ☃", "long caption " * 30]
RESNET = ['model.vision={"kind": "clip_resnet", "embedding_size": 8, "depths": [1, 2, 1, 1], '
          '"hidden_sizes": [32, 64, 128, 256], "heads": 4, "pool_dim": 48}', "data.image_size=64"]


@pytest.fixture(scope="module")
def vocabulary(tmp_path_factory):
    """A file in CLIP's BPE vocabulary format (a header and 48,894 merges): the one open_clip ships
    where it is installed, else merges of byte pairs made here (other ids, the same machinery)."""
    shipped = clip_bpe.packaged_bpe()
    if shipped is not None:
        return shipped
    chars = list(clip_bpe.bytes_to_unicode().values())
    pairs = [f"{a} {b}" for b in chars + [c + "</w>" for c in chars] for a in chars][: clip_bpe.MERGES]
    path = tmp_path_factory.mktemp("bpe") / clip_bpe.BPE_FILE
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        fh.write("#version: 0.2\n" + "\n".join(pairs) + "\n")
    return path


def saved(tmp_path, micro_overrides, vocabulary, extra=(), seed=0):
    """A micro model with CLIP's BPE tokenizer, weights moved off their initial values and random
    BatchNorm statistics, saved as RUN/model; (run, model)."""
    cfg = resolve("micro", micro_overrides + ["objective.name=clip", f"model.text.tokenizer={vocabulary}", *extra])
    torch.manual_seed(seed)
    model = build_model(cfg, pretrained_text=False).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    save_model(model, cfg, tmp_path / "run" / "model")
    return tmp_path / "run", model


def export(run, out, *extra) -> int:
    return main(["export", "--checkpoint", str(run), "--open-clip", str(out), *extra])


def cosines(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.double(), b.double()).min().item()


CASES = {"vit": [], "vit-quickgelu-argmax-stats": ["model.vision.hidden_act=quick_gelu",
                                                   "model.text.hidden_act=quick_gelu", "model.text.eos_pooling=argmax",
                                                   "model.vision.pixel_mean=[0.5,0.5,0.5]",
                                                   "model.vision.pixel_std=[0.25,0.3,0.35]",
                                                   "data.eval_resize=squash", "data.eval_interpolation=bilinear"],
         "clip_resnet": RESNET}


@pytest.mark.parametrize("name", list(CASES))
def test_nclip_reads_back_the_same_model(tmp_path, micro_overrides, vocabulary, name):
    run, model = saved(tmp_path, micro_overrides, vocabulary, CASES[name])
    assert export(run, tmp_path / "oc") == 0
    files = sorted(p.name for p in (tmp_path / "oc").iterdir())
    assert files == sorted(["open_clip_config.json", "open_clip_model.safetensors", clip_bpe.BPE_FILE,
                            "nclip_export.json"])
    config = json.loads((tmp_path / "oc" / "open_clip_config.json").read_text())
    assert set(config) == {"model_cfg", "preprocess_cfg"}
    assert {"size", "mean", "std", "interpolation", "resize_mode"} <= set(config["preprocess_cfg"])

    original, exported = nclip.load(run, device="cpu"), nclip.load(tmp_path / "oc", device="cpu")
    size = original.image_size
    assert exported.image_size == size and exported.model.eval_resize == original.model.eval_resize
    torch.manual_seed(1)
    pixels = torch.randn(4, 3, size, size)
    assert cosines(exported.encode_image(pixels), original.encode_image(pixels)) >= 0.9999
    assert cosines(exported.encode_text(CAPTIONS), original.encode_text(CAPTIONS)) >= 0.9999
    assert abs(exported.logit_scale - original.logit_scale) < 1e-4
    if name == "vit":  # open_clip's names: the fused attention projection and visual.proj
        state = load_file(str(tmp_path / "oc" / "open_clip_model.safetensors"))
        assert "visual.transformer.resblocks.0.attn.in_proj_weight" in state and "visual.proj" in state


def test_the_resnet_names_are_the_readers_backwards(tmp_path, micro_overrides, vocabulary):
    _, model = saved(tmp_path, micro_overrides, vocabulary, RESNET)
    tower = model.vision.state_dict()
    back = resnet_names(resnet_state(tower))
    assert sorted(back) == sorted(f"vision.{k}" for k in tower)
    assert all(back[f"vision.{k}"] is v for k, v in tower.items())


def test_open_clip_loads_the_export(tmp_path, micro_overrides, vocabulary):
    """open_clip itself (skipped where it is not installed) builds the exported model from the folder
    and encodes as nclip does."""
    oc = open_clip()
    run, _ = saved(tmp_path, micro_overrides, vocabulary, CASES["vit-quickgelu-argmax-stats"])
    assert export(run, tmp_path / "oc") == 0
    model, _, preprocess = oc.create_model_and_transforms(f"local-dir:{tmp_path / 'oc'}")
    tokenizer = oc.get_tokenizer(f"local-dir:{tmp_path / 'oc'}")
    ours = nclip.load(run, device="cpu")
    pixels = torch.randn(3, 3, ours.image_size, ours.image_size)
    # open_clip normalises with the tower's own statistics (preprocess_cfg): nclip's pixels are CLIP's
    v = ours.cfg.model.vision
    raw = pixels * torch.from_numpy(CLIP_STD).view(1, 3, 1, 1) + torch.from_numpy(CLIP_MEAN).view(1, 3, 1, 1)
    theirs_pixels = (raw - torch.tensor(v.pixel_mean).view(1, 3, 1, 1)) / torch.tensor(v.pixel_std).view(1, 3, 1, 1)
    with torch.no_grad():
        image = model.eval().encode_image(theirs_pixels, normalize=True)
        text = model.encode_text(tokenizer(CAPTIONS), normalize=True)
    assert cosines(image, ours.encode_image(pixels)) >= 0.9999
    assert cosines(text, ours.encode_text(CAPTIONS)) >= 0.9999
    assert preprocess is not None  # open_clip built its eval transform from preprocess_cfg


REFUSED = [
    (["objective.name=nclip"], "no CLIP head"),
    (["objective.name=xclip", "model.nclip_shared_layers=1"], "MLP"),
    (['model.vision={"kind": "convnet", "embedding_size": 8, "depths": [1, 1], "hidden_sizes": [16, 32], '
      '"heads": 2}'], "image tower is 'convnet'"),
    (["model.text.kind=pretrained"], "MiniLM"),
    (["model.text.hidden_act=quick_gelu"], "different activations"),
]


def test_open_clip_export_asks_the_zero_shot_score(tmp_path, micro_overrides, vocabulary, monkeypatch, capsys):
    """open_clip scores by the cosine of the CLIP head: a model that nclip scores zero-shot otherwise
    (a plugin's own score beside a CLIP head) is refused in one line."""
    from dataclasses import replace

    import nclip.objectives
    from nclip.objectives.scores import YclipScore

    run, _ = saved(tmp_path, micro_overrides, vocabulary, ["objective.name=xclip"])
    plan = nclip.objectives.plan_for
    monkeypatch.setattr(nclip.objectives, "plan_for", lambda run_cfg: replace(plan(run_cfg), zero_shot=YclipScore()))
    assert export(run, tmp_path / "oc") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "transfers zero-shot with the 'yclip' score (nclip head)" in err[0], err
    assert not (tmp_path / "oc").exists()


@pytest.mark.parametrize("extra, why", REFUSED, ids=[w for _, w in REFUSED])
def test_what_open_clip_cannot_express_is_one_line(tmp_path, micro_overrides, vocabulary, capsys, extra, why):
    run, _ = saved(tmp_path, micro_overrides, vocabulary, extra)
    assert export(run, tmp_path / "oc") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "open_clip cannot express" in err[0] and why in err[0], err
    assert not (tmp_path / "oc").exists()  # nothing left behind: not even the lock's folder


def test_the_wordpiece_tokenizer_is_refused(tmp_path, micro_overrides, capsys):
    cfg = resolve("micro", micro_overrides + ["objective.name=clip"])
    save_model(build_model(cfg, pretrained_text=False), cfg, tmp_path / "m")
    assert export(tmp_path / "m", tmp_path / "oc") == 2
    err = capsys.readouterr().err
    assert "not CLIP's BPE" in err and "WordPiece" in err and len(err.strip().splitlines()) == 1
