"""OpenCLIP and OpenAI checkpoints in (nclip.models.openclip_files, openclip_import,
torchscript_archive): nclip.load and model.init on models open_clip builds here with random weights."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import nclip
from nclip.config import validate
from nclip.errors import NclipError
from nclip.models import build_model
from nclip.models.hf_import import init_config, load_init_weights

from openclip_refs import build, encodings, open_clip, resnet_cfg, save_hub, vit_cfg

CAPTIONS = ["a photo of a cat", "two dogs playing on the beach at sunset", "", "!!!", "Ünïcödé ☃ 東京",
            "a very long caption " * 30]
CASES = {
    "vit-gelu": (vit_cfg(), False),
    "vit-quickgelu": (vit_cfg(quick_gelu=True, patch=4, image=24, mlp_ratio=2.0, final_ln_after_pool=True), False),
    "vit-customtext": ({**vit_cfg(head_width=16), "custom_text": True}, True),
    "rn-1111": (resnet_cfg(), False),
    "rn-2131-w24": (resnet_cfg(layers=(2, 1, 3, 1), width=24, image=96, head_width=48), False),
}


def cosines(got: torch.Tensor, want: torch.Tensor) -> float:
    return F.cosine_similarity(got.double(), want.double()).min().item()


def assert_same_encodings(model, loaded, size: int, seed: int = 1):
    torch.manual_seed(seed)
    pixels = torch.randn(3, 3, size, size)
    want_i, want_t = encodings(model, pixels, CAPTIONS)
    assert cosines(loaded.encode_image(pixels), want_i) >= 0.9999
    assert cosines(loaded.encode_text(CAPTIONS), want_t) >= 0.9999


@pytest.mark.parametrize("name", list(CASES))
def test_an_open_clip_directory_encodes_as_open_clip(tmp_path, name):
    cfg, custom = CASES[name]
    model = build(cfg, custom_text=custom)
    fmt = "bin" if custom else "safetensors"  # open_clip_pytorch_model.bin too, read with weights_only
    loaded = nclip.load(save_hub(model, cfg, tmp_path / "oc", fmt=fmt), device="cpu")
    vision = loaded.cfg.model.vision
    assert vision.kind == ("clip_resnet" if name.startswith("rn") else "vit")
    assert loaded.cfg.model.text.eos_pooling == "argmax" and loaded.tokenizer.vocab_size == 49408
    assert_same_encodings(model, loaded, cfg["vision_cfg"]["image_size"])
    assert abs(loaded.logit_scale - float(model.logit_scale.exp())) < 1e-4


def test_text_pooled_at_the_first_end_of_text_token(tmp_path):
    cfg = vit_cfg()
    cfg["text_cfg"].update(pool_type="eos", eos_id=49407)
    model = build(cfg)
    loaded = nclip.load(save_hub(model, cfg, tmp_path / "oc"), device="cpu")
    assert loaded.cfg.model.text.eos_pooling == "token"
    assert_same_encodings(model, loaded, 32)


PREPROCESS = [("vit-gelu", "shortest", "bicubic"), ("rn-1111", "shortest", "bicubic"),
              ("vit-gelu", "squash", "bilinear"), ("rn-1111", "squash", "bicubic"),
              ("vit-gelu", "shortest", "bilinear")]


@pytest.mark.parametrize("name, mode, interpolation", PREPROCESS, ids=["-".join(p) for p in PREPROCESS])
def test_images_get_the_checkpoints_preprocessing(tmp_path, name, mode, interpolation):
    """A PIL image through LoadedModel.transform and the tower's pixel statistics = open_clip's own
    eval transform (size, resize mode, interpolation, the checkpoint's mean and std)."""
    oc = open_clip()
    cfg, _ = CASES[name]
    size = cfg["vision_cfg"]["image_size"]
    pre = {"mean": [0.5, 0.45, 0.4], "std": [0.2, 0.25, 0.3], "interpolation": interpolation, "resize_mode": mode}
    model = build(cfg)
    loaded = nclip.load(save_hub(model, cfg, tmp_path / "oc", preprocess=pre), device="cpu")
    assert list(loaded.cfg.model.vision.pixel_mean) == pre["mean"] and loaded.image_size == size
    assert (loaded.cfg.data.eval_resize, loaded.cfg.data.eval_interpolation) == (mode, interpolation)
    rng = np.random.default_rng(0)
    # 50×90 at 64 px overhangs by 51 px, 3 (mod 4): torchvision's crop rounds where transformers' floors;
    # P and RGBA images become RGB after the resize in open_clip's transform
    images = [Image.fromarray(rng.integers(0, 256, (h, w, c), dtype=np.uint8)) for h, w, c in
              ((50, 90, 3), (size + 20, size // 2, 3), (size, size, 3), (size + 9, size + 30, 4))]
    images.append(images[1].quantize(colors=32))
    transform = oc.transform.image_transform(size, is_train=False, mean=pre["mean"], std=pre["std"],
                                             interpolation=interpolation, resize_mode=mode)
    with torch.no_grad():
        want = model.encode_image(torch.stack([transform(im) for im in images]), normalize=True)
    assert float((loaded.encode_image(images) - want).abs().max()) <= 1e-5


def _script(model, path, half: bool = True):
    """OpenAI's release format: the model scripted with fp16 weights (returns the float32 reference)."""
    oc = open_clip()
    if half:
        oc.model.convert_weights_to_lp(model, torch.float16)
    torch.jit.script(model).save(str(path))
    return model.float()


@pytest.mark.parametrize("kind", ["vit", "rn"])
def test_openais_torchscript_archive_is_read_without_running_it(tmp_path, monkeypatch, kind):
    # OpenAI's archives hold no config: heads of width 64 and QuickGELU, as open_clip infers them
    cfg = vit_cfg(quick_gelu=True, width=128, head_width=64, text_width=128) if kind == "vit" else \
        {**resnet_cfg(width=16, image=64), "quick_gelu": True}
    cfg["text_cfg"].update(width=128, heads=2)
    reference = _script(build(cfg), tmp_path / "model.pt")

    def refuse(*args, **kwargs):
        raise AssertionError("the archive's code was loaded")

    monkeypatch.setattr(torch.jit, "load", refuse)
    loaded = nclip.load(tmp_path / "model.pt", device="cpu")
    assert loaded.cfg.model.text.hidden_act == "quick_gelu"
    assert_same_encodings(reference, loaded, cfg["vision_cfg"]["image_size"])


@pytest.mark.slow
def test_a_state_dict_with_arch_in_the_full_vit_b_32_shape(tmp_path):
    """One full-size model: ViT-B-32 (open_clip's config, read from the installed package), saved as
    an open_clip training checkpoint (state_dict wrapped, DDP's module. prefix)."""
    oc = open_clip()
    torch.manual_seed(0)
    model = oc.create_model("ViT-B-32").eval()
    state = {f"module.{k}": v for k, v in model.state_dict().items()}
    torch.save({"epoch": 1, "state_dict": state}, tmp_path / "epoch_1.pt")
    del state
    loaded = nclip.load(tmp_path / "epoch_1.pt", device="cpu", arch="ViT-B-32")
    v, t = loaded.cfg.model.vision, loaded.cfg.model.text
    assert (v.width, v.layers, v.heads, v.patch_size, t.width, t.layers, loaded.image_size) == \
        (768, 12, 12, 32, 512, 12, 224)
    assert_same_encodings(model, loaded, 224)


def test_init_config_names_the_source_and_the_clip_head_loads(tmp_path):
    cfg = resnet_cfg()
    model = build(cfg)
    save_hub(model, cfg, tmp_path / "oc")
    notes = []
    run_cfg = init_config(validate({"model": {"init": str(tmp_path / "oc")}, "objective": {"name": "xclip"}}),
                          note=notes.append)
    assert "(an open_clip directory)" in notes[0] and "clip_resnet" in notes[0]
    assert run_cfg.model.vision.pool_dim == run_cfg.model.embed_dim == 32
    net = build_model(run_cfg).eval()
    line = load_init_weights(net, run_cfg.model.init)
    assert "the CLIP head and logit scale" in line
    torch.testing.assert_close(net.heads["clip"].image.weight, torch.eye(32))


def test_nclip_load_imports_neither_open_clip_nor_timm(tmp_path):
    cfg = vit_cfg()
    save_hub(build(cfg), cfg, tmp_path / "oc")
    probe = ("import sys, nclip; m = nclip.load(sys.argv[1], device='cpu'); m.encode_text(['a cat']); "
             "print([n for n in ('open_clip', 'timm') if n in sys.modules])")
    done = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "oc")], capture_output=True, text=True,
                          timeout=300)
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stderr[-2000:]


@pytest.mark.slow
def test_init_from_an_open_clip_directory_trains_xclip(tmp_path, micro_overrides):
    from nclip.models.io import load_model
    from nclip.train.loop import train

    cfg = vit_cfg(quick_gelu=True)
    model = build(cfg)
    save_hub(model, cfg, tmp_path / "oc")
    overrides = micro_overrides + ["objective.name=xclip", "train.steps=2", "train.lr=1e-12", "train.min_lr=0",
                                   "train.warmup_steps=0", "train.checkpoint_every=2", "model.nclip_dim=64",
                                   f"model.init={tmp_path / 'oc'}"]
    from nclip.config import resolve

    result = train(resolve("micro", overrides), tmp_path / "run", progress=False, evaluate=False)
    assert result.steps == 2 and any("nclip" in k for k in result.metrics), sorted(result.metrics)
    (tmp_path / "oc").rename(tmp_path / "gone")  # the run stands alone: its tokenizer is copied beside the model
    net, run_cfg = load_model(tmp_path / "run" / "model")
    assert (tmp_path / "run" / "model" / "tokenizer" / "bpe_simple_vocab_16e6.txt.gz").is_file()
    assert run_cfg.model.vision.hidden_act == "quick_gelu" and run_cfg.data.text_length == 77
    loaded = nclip.load(tmp_path / "run", device="cpu")
    assert_same_encodings(model, loaded, 32)  # lr 1e-12: still open_clip's weights


# ---------------------------------------------------------------------------------------------
# one line for each broken or mismatched file
# ---------------------------------------------------------------------------------------------


def _one_line(match: str, path, arch=None):
    with pytest.raises(NclipError, match=match) as e:
        nclip.load(path, device="cpu", arch=arch)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_broken_files_are_one_line_each(tmp_path):
    cfg = vit_cfg()
    model = build(cfg)
    good = save_hub(model, cfg, tmp_path / "good")
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "open_clip_config.json").write_text(json.dumps({"model_cfg": cfg}))
    _one_line("neither open_clip_model.safetensors nor open_clip_pytorch_model.bin", tmp_path / "noweights")
    (tmp_path / "nocfg").mkdir()
    (tmp_path / "nocfg" / "open_clip_config.json").write_text(json.dumps({"preprocess_cfg": {}}))
    _one_line("has no model_cfg", tmp_path / "nocfg")
    (tmp_path / "badjson").mkdir()
    (tmp_path / "badjson" / "open_clip_config.json").write_text("{not json")
    _one_line("", tmp_path / "badjson")
    corrupt = save_hub(model, cfg, tmp_path / "corrupt")
    (corrupt / "open_clip_model.safetensors").write_bytes(b"\x00" * 64)
    _one_line("cannot read", corrupt)
    torch.save(model.state_dict(), tmp_path / "trunc.bin")
    (tmp_path / "trunc.bin").write_bytes((tmp_path / "trunc.bin").read_bytes()[:5000])
    _one_line("cannot read .* as a state dict", tmp_path / "trunc.bin", arch="ViT-B-32")
    torch.save({"epoch": 1, "state_dict": model.state_dict()}, tmp_path / "epoch_1.pt")
    _one_line("is an open_clip training checkpoint .*--arch NAME", tmp_path / "epoch_1.pt")
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    _one_line("--arch ViT-Q-99: not one of open_clip's", tmp_path / "weights.pt", arch="ViT-Q-99")
    _one_line("has shape", tmp_path / "weights.pt", arch="ViT-B-32")  # the wrong architecture
    other = dict(cfg, vision_cfg=dict(cfg["vision_cfg"], width=96))
    (good / "open_clip_config.json").write_text(json.dumps({"model_cfg": other}))
    _one_line("has shape", good)


def test_a_torchscript_archive_that_calls_anything_else_is_refused(tmp_path):
    """An archive whose data.pkl names another global (here os.system) is refused, never called."""
    import pickle
    import zipfile

    class Evil:
        def __reduce__(self):
            import os

            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    with zipfile.ZipFile(tmp_path / "evil.pt", "w") as zf:
        zf.writestr("evil/data.pkl", pickle.dumps(Evil(), protocol=2))
        zf.writestr("evil/code/__torch__/x.py", "")
    _one_line("unexpected global", tmp_path / "evil.pt")
    assert not (tmp_path / "pwned").exists()


REFUSED = [
    (("vision_cfg", "timm_model_name"), "vit_base_patch16_224", "vision_cfg.timm_model_name"),
    (("vision_cfg", "ls_init_value"), 1e-5, "vision_cfg.ls_init_value"),
    (("vision_cfg", "pool_type"), "avg", "vision_cfg.pool_type"),
    (("vision_cfg", "norm_kwargs"), {"eps": 1e-6}, "vision_cfg.norm_kwargs"),
    (("vision_cfg", "image_size"), [32, 64], "not square"),
    (("text_cfg", "hf_model_name"), "roberta-base", "text_cfg.hf_model_name"),
    (("text_cfg", "pool_type"), "last", "text_cfg.pool_type"),
    (("text_cfg", "tokenizer_kwargs"), {"clean": "canonicalize"}, "tokenizer_kwargs"),
    (("text_cfg", "act_kwargs"), {"approximate": "tanh"}, "text_cfg.act_kwargs"),
    (("multimodal_cfg",), {"width": 64}, "model_cfg.multimodal_cfg"),
    (("preprocess", "resize_mode"), "longest", "preprocess_cfg.resize_mode"),
    (("preprocess", "interpolation"), "random", "preprocess_cfg.interpolation"),
]


@pytest.mark.parametrize("where, value, match", REFUSED, ids=[m for *_, m in REFUSED])
def test_what_nclip_cannot_reproduce_is_refused_in_one_line(tmp_path, where, value, match):
    cfg, pre = vit_cfg(), {}
    if where[0] == "preprocess":
        pre[where[1]] = value
    elif len(where) == 1:
        cfg[where[0]] = value
    else:
        cfg[where[0]][where[1]] = value
    (tmp_path / "oc").mkdir()
    (tmp_path / "oc" / "open_clip_config.json").write_text(json.dumps({"model_cfg": cfg, "preprocess_cfg": pre}))
    (tmp_path / "oc" / "open_clip_model.safetensors").write_bytes(b"")  # never read: the config is refused first
    text = _one_line(match, tmp_path / "oc")
    assert str(tmp_path / "oc") in text


def test_cli_eval_and_train_take_arch(tmp_path, capsys):
    from nclip.cli import main

    torch.save({"epoch": 1, "state_dict": build(vit_cfg()).state_dict()}, tmp_path / "w.pt")  # open_clip's
    assert main(["eval", "--checkpoint", str(tmp_path / "w.pt"), "--out", str(tmp_path / "ev")]) == 2
    err = capsys.readouterr().err
    assert "--arch" in err and err.count("\n") == 1 and "Traceback" not in err
    assert f"--checkpoint {tmp_path / 'w.pt'}: " in err
    assert main(["train", "--preset", "micro", "--init", str(tmp_path / "w.pt"), "--out", str(tmp_path / "run"),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--arch" in err and err.count("\n") == 1 and f"--init {tmp_path / 'w.pt'}: " in err
    assert main(["train", "--preset", "micro", "--init", str(tmp_path / "w.pt"), "--arch", "ViT-B-32",
                 "--out", str(tmp_path / "run"), "--no-progress", "--set", "train.steps=1"]) == 2
    err = capsys.readouterr().err.splitlines()  # the line naming what model.init replaces, then the error
    assert "has shape" in err[-1] and "an open_clip state dict of ViT-B-32" in err[0]
    assert len(err) == 2 and not any("Traceback" in line for line in err)
    assert main(["train", "--preset", "micro", "--arch", "ViT-B-32", "--out", str(tmp_path / "run2")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "init_arch" in err[0] and "give model.init" in err[0]


def test_eval_takes_a_state_dict_with_arch_and_a_directory_as_baseline(tmp_path, monkeypatch):
    """nclip eval --checkpoint FILE --arch NAME --baseline DIR: the same model both ways, relative 0."""
    from nclip.cli import main
    from nclip.models import openclip_files

    cfg = vit_cfg()
    monkeypatch.setattr(openclip_files, "builtin_config", lambda arch: cfg)  # a small "built-in" config
    model = build(cfg)
    torch.save(model.state_dict(), tmp_path / "w.pt")
    save_hub(model, cfg, tmp_path / "oc")
    realms = tmp_path / "realms"
    for realm in ("photo", "sketch"):
        for name, colour in (("red", (200, 30, 30)), ("blue", (30, 30, 200))):
            (realms / realm / name).mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (40, 30), tuple(v + 5 * i for v in colour)).save(realms / realm / name / f"{i}.png")
    out = tmp_path / "eval"
    assert main(["eval", "--checkpoint", str(tmp_path / "w.pt"), "--arch", "Tiny", "--out", str(out), "--tasks",
                 "realms", "--dataset", f"realms:{realms}", "--baseline", str(tmp_path / "oc"), "--no-report",
                 "--no-cache", "--quiet"]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["checkpoint"]["format"] == "open_clip state dict of Tiny" and doc["checkpoint"]["head"] == "clip"
    relative = [k for k in doc["results"] if k.startswith("realms/") and "relative" in k]
    assert relative and all(doc["results"][k] == pytest.approx(0.0, abs=1e-9) for k in relative)


@pytest.mark.parametrize("arch", ["RN50", "RN101", "RN50x4", "ViT-B-16", "ViT-L-14-336", "ViT-B-32-quickgelu"])
def test_full_size_configs_map_weight_for_weight(tmp_path, arch):
    """open_clip's own configs at full size, built on the meta device (shapes, no memory): every
    tensor of nclip's towers, CLIP head and logit scale has its open_clip counterpart of that shape."""
    from nclip.models.hf_import import copy_weights
    from nclip.models.openclip_files import builtin_config
    from nclip.models.openclip_import import transformers_names

    oc = open_clip()
    cfg = builtin_config(arch)
    (tmp_path / "oc").mkdir()
    (tmp_path / "oc" / "open_clip_config.json").write_text(json.dumps({"model_cfg": cfg}))
    (tmp_path / "oc" / "open_clip_model.safetensors").write_bytes(b"")  # init_config reads the config only
    run_cfg = init_config(validate({"model": {"init": str(tmp_path / "oc")}, "objective": {"name": "xclip"}}),
                          note=lambda line: None)
    with torch.device("meta"):
        reference, net = oc.model.CLIP(**cfg), build_model(run_cfg)
    source = transformers_names(reference.state_dict(), net.vision.width)
    assert "the CLIP head and logit scale" in copy_weights(net, source, True, tmp_path / "oc")
    used = {k for k in source if not k.endswith("position_ids")}
    tower_tensors = sum(1 for k in net.state_dict() if k.startswith(("vision.", "text.")) and "position_ids" not in k)
    assert tower_tensors + 3 == len(used)  # each open_clip tensor lands somewhere: towers, two projections, scale
    v, size = run_cfg.model.vision, cfg["vision_cfg"]["image_size"]
    assert run_cfg.data.image_size == size and run_cfg.model.embed_dim == cfg["embed_dim"]
    if arch.startswith("RN"):
        assert v.kind == "clip_resnet" and list(v.depths) == cfg["vision_cfg"]["layers"]
    else:
        assert v.hidden_act == ("quick_gelu" if cfg.get("quick_gelu") else "gelu")
