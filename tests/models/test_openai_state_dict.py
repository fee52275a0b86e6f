"""State dicts in OpenAI's CLIP layout (nclip.models.openai_layout, openclip_files, openclip_import):
custom sizes load with no --arch, their architecture read from the tensors as OpenAI's own
``clip.model.build_model`` reads it, and equal OpenAI's code; OpenAI's weights never get GELU in
silence; errors name the user's option and file."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import nclip
from nclip.errors import NclipError
from nclip.models import openclip_files

from openclip_refs import build, open_clip, openai_reference, vit_cfg

CAPTIONS = ["a photo of a cat", "two dogs playing on the beach at sunset", "", "!!!", "Ünïcödé ☃ 東京",
            "a very long caption " * 30]
TEXT = {"context_length": 20, "vocab_size": 49408, "transformer_width": 64, "transformer_heads": 1,
        "transformer_layers": 2}
# sizes none of open_clip's configs has: a 6-px patch on a 5×5 grid, ResNet stages (1, 2, 1, 1) 16 wide,
# 20 text tokens, a 48-wide embedding
SIZES = {"vit": {"embed_dim": 48, "image_resolution": 30, "vision_layers": 3, "vision_width": 128,
                 "vision_patch_size": 6, **TEXT},
         "rn": {"embed_dim": 48, "image_resolution": 64, "vision_layers": (1, 2, 1, 1), "vision_width": 16,
                "vision_patch_size": None, **TEXT}}


def _save(state: dict, path):
    if path.suffix == ".safetensors":
        save_file(state, str(path))
    else:
        torch.save(state, path)
    return path


def assert_equals_openai(reference, loaded, size: int):
    """nclip's image and text embeddings equal OpenAI's model's on the same pixels and token ids (the
    ids: OpenAI's own clip.tokenize, which nclip's tokenizer must give too)."""
    import clip

    torch.manual_seed(1)
    pixels = torch.randn(3, 3, size, size)
    ids, mask = loaded.tokenizer(CAPTIONS)
    want_ids = clip.tokenize(CAPTIONS, context_length=TEXT["context_length"], truncate=True)
    assert torch.equal(ids.long(), want_ids.long())
    with torch.no_grad():
        want = F.normalize(reference.encode_image(pixels), dim=-1), F.normalize(reference.encode_text(want_ids), dim=-1)
    got = loaded.encode_image(pixels), loaded.encode_text((ids, mask))
    for g, w in zip(got, want):
        assert F.cosine_similarity(g.double(), w.double()).min().item() >= 0.9999
        assert (g - w).abs().max().item() <= 1e-5  # GELU instead of QuickGELU: 2e-3 image, 4e-3 text


@pytest.mark.parametrize("kind, suffix", [("vit", ".pt"), ("vit", ".safetensors"), ("rn", ".bin")])
def test_an_openai_state_dict_of_a_custom_size_loads_without_arch(tmp_path, capfd, kind, suffix):
    reference, state = openai_reference(**SIZES[kind])
    path = _save(state, tmp_path / f"custom{suffix}")
    capfd.readouterr()
    loaded = nclip.load(path, device="cpu")
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 1 and str(path) in err[0] and "QuickGELU" in err[0] and "--arch" in err[0], err
    v, t, sizes = loaded.cfg.model.vision, loaded.cfg.model.text, SIZES[kind]
    assert t.hidden_act == "quick_gelu" and (t.width, t.layers, t.heads) == (64, 2, 1)
    assert (loaded.image_size, loaded.cfg.data.text_length, loaded.cfg.model.embed_dim) == \
        (sizes["image_resolution"], 20, 48)
    if kind == "vit":
        assert (v.kind, v.hidden_act, v.width, v.layers, v.heads, v.patch_size) == ("vit", "quick_gelu", 128, 3, 2, 6)
    else:
        assert (v.kind, list(v.depths), v.embedding_size, v.heads) == ("clip_resnet", [1, 2, 1, 1], 16, 8)
    assert_equals_openai(reference, loaded, sizes["image_resolution"])


def test_nclip_eval_takes_an_openai_state_dict_without_arch(tmp_path):
    """The CLI path: `nclip eval --checkpoint FILE` with no --arch, recorded as an OpenAI state dict."""
    from nclip.cli import main

    _, state = openai_reference(**SIZES["vit"])
    path = _save(state, tmp_path / "custom.pt")
    assert main(["eval", "--checkpoint", str(path), "--out", str(tmp_path / "ev"), "--tasks", "zeroshot",
                 "--samples", "40", "--no-report", "--no-cache", "--quiet"]) == 0
    doc = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert doc["checkpoint"]["format"] == "OpenAI state dict"


# ---------------------------------------------------------------------------------------------
# OpenAI's weights never get GELU in silence
# ---------------------------------------------------------------------------------------------


def _openai_entries(state: dict) -> dict:
    """The state dict of OpenAI's released (TorchScript) model, as its state_dict() gives it: with
    the plain-number entries OpenAI's build_model deletes."""
    return {**state, "input_resolution": torch.tensor(30), "context_length": torch.tensor(20),
            "vocab_size": torch.tensor(49408)}


def _script(model, path):
    """OpenAI's release format: a scripted model with fp16 weights (open_clip's CLIP, OpenAI's layout)."""
    open_clip().model.convert_weights_to_lp(model, torch.float16)
    torch.jit.script(model).save(str(path))
    return path


@pytest.fixture
def tiny_arch(monkeypatch):
    """open_clip configs "Tiny" (GELU) and "Tiny-quickgelu" of SIZES["vit"]'s shape, as if shipped."""
    cfg = {"embed_dim": 48, "vision_cfg": {"image_size": 30, "layers": 3, "width": 128, "patch_size": 6},
           "text_cfg": {"context_length": 20, "vocab_size": 49408, "width": 64, "heads": 1, "layers": 2}}
    configs = {"Tiny": cfg, "Tiny-quickgelu": {**cfg, "quick_gelu": True}}
    monkeypatch.setattr(openclip_files, "builtin_config", lambda arch: configs[arch])
    monkeypatch.setattr(openclip_files, "has_builtin", lambda arch: arch in configs)


def test_openais_weights_with_a_gelu_arch_are_refused_naming_the_quickgelu_one(tmp_path, tiny_arch):
    reference, state = openai_reference(**SIZES["vit"])
    path = _save(_openai_entries(state), tmp_path / "openai.safetensors")
    with pytest.raises(NclipError) as e:
        nclip.load(path, device="cpu", arch="Tiny")
    message = str(e.value)
    assert message.startswith(f"{path}: holds OpenAI's weights") and "input_resolution" in message
    assert "--arch Tiny builds GELU" in message and "give --arch Tiny-quickgelu, or no --arch" in message
    loaded = nclip.load(path, device="cpu", arch="Tiny-quickgelu")  # what the error asks for
    assert_equals_openai(reference, loaded, 30)
    loaded = nclip.load(path, device="cpu")  # or no --arch: the same model, and no line (the file says whose)
    assert loaded.cfg.model.text.hidden_act == "quick_gelu"
    assert_equals_openai(reference, loaded, 30)


def test_the_cli_refuses_vit_b_32_on_openais_archive_and_state_dict(tmp_path, capsys):
    """The README's old example, `--arch ViT-B-32` on OpenAI's weights: one line naming the option the
    user gave the file with and ViT-B-32-quickgelu, under eval and train alike."""
    from nclip.cli import main

    cfg = vit_cfg(quick_gelu=True, width=128, head_width=64, text_width=64, text_heads=1)
    archive = _script(build(cfg), tmp_path / "ViT-B-32.pt")
    _, state = openai_reference(**SIZES["vit"])
    entries = _save(_openai_entries(state), tmp_path / "openai.pt")
    for path in (archive, entries):
        assert main(["eval", "--checkpoint", str(path), "--arch", "ViT-B-32", "--out", str(tmp_path / "ev")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"nclip: error: --checkpoint {path}: holds OpenAI's"), err
        assert "--arch ViT-B-32-quickgelu" in err and "model.init" not in err
    assert main(["train", "--preset", "micro", "--init", str(entries), "--arch", "ViT-B-32", "--out",
                 str(tmp_path / "run"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"nclip: error: --init {entries}: holds OpenAI's"), err
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------
# what is refused, in the user's words
# ---------------------------------------------------------------------------------------------


def test_an_open_clip_training_checkpoint_without_arch_asks_for_it(tmp_path, capsys):
    """open_clip trains GELU and QuickGELU models alike: its checkpoints need --arch."""
    from nclip.cli import main

    model = build(vit_cfg())
    torch.save({"epoch": 3, "state_dict": {f"module.{k}": v for k, v in model.state_dict().items()}},
               tmp_path / "epoch_3.pt")
    assert main(["eval", "--checkpoint", str(tmp_path / "epoch_3.pt"), "--out", str(tmp_path / "ev")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--checkpoint {tmp_path / 'epoch_3.pt'}: is an open_clip training" in err
    assert "--arch NAME" in err


def test_weights_that_fit_no_openai_clip_are_one_line(tmp_path):
    _, state = openai_reference(**SIZES["vit"])
    odd = {**state, "visual.positional_embedding": state["visual.positional_embedding"][:-1]}
    with pytest.raises(NclipError, match="25 positions, not a square grid"):
        nclip.load(_save(odd, tmp_path / "odd.pt"), device="cpu")
    no_text = {k: v for k, v in state.items() if k != "ln_final.weight"}
    with pytest.raises(NclipError, match="not a CLIP state dict in OpenAI's layout.*--arch NAME") as e:
        nclip.load(_save(no_text, tmp_path / "no_text.pt"), device="cpu")
    assert "ln_final" not in str(e.value)
    narrow = build(vit_cfg(width=32, head_width=32)).state_dict()  # OpenAI's CLIP: 32 // 64 = 0 heads
    with pytest.raises(NclipError, match="image tower is 32 wide, which OpenAI's CLIP cannot split"):
        nclip.load(_save(narrow, tmp_path / "narrow.pt"), device="cpu")


def test_a_wrong_arch_names_the_files_own_tensor_and_the_users_option(tmp_path, capsys, tiny_arch):
    """A shape mismatch names the tensor as the file names it (never nclip's or transformers' names)
    and the option: --checkpoint under eval, --init under train, the path alone under nclip.load."""
    from nclip.cli import main

    torch.save(build(vit_cfg()).state_dict(), tmp_path / "w.pt")  # 64 wide; Tiny is 128
    problem = f"{tmp_path / 'w.pt'}: visual.class_embedding has shape (64,), where --arch Tiny has (128,)"
    with pytest.raises(NclipError) as e:
        nclip.load(tmp_path / "w.pt", device="cpu", arch="Tiny")
    assert str(e.value) == problem
    assert main(["eval", "--checkpoint", str(tmp_path / "w.pt"), "--arch", "Tiny", "--out", str(tmp_path / "ev"),
                 "--tasks", "zeroshot", "--samples", "40", "--quiet"]) == 2
    assert capsys.readouterr().err == f"nclip: error: --checkpoint {problem}\n"
    assert main(["train", "--preset", "micro", "--init", str(tmp_path / "w.pt"), "--arch", "Tiny",
                 "--out", str(tmp_path / "run"), "--no-progress", "--set", "train.steps=1"]) == 2
    err = capsys.readouterr().err.splitlines()  # the line naming what model.init replaces, then the error
    assert len(err) == 2 and "an open_clip state dict of Tiny" in err[0]
    assert err[1] == f"nclip: error: --init {problem}"
