"""model.init: starting from a transformers CLIPModel directory or an nclip model (nclip.models.hf_import)."""

import json

import pytest
import torch
from hf_fixtures import features, hf_pixels, nclip_pixels, save_tiny_clip

import nclip
from nclip.cli import main
from nclip.config import resolve, validate
from nclip.errors import NclipError
from nclip.models import build_model
from nclip.models.hf_import import init_config, load_init_weights
from nclip.models.io import load_model, save_model

CAPTIONS = ["the red circle left of a blue square and two more green stars", "a", "the the"]


def _from_init(directory, objective="xclip", notes=None):
    cfg = init_config(validate({"model": {"init": str(directory)}, "objective": {"name": objective}}),
                      note=(notes.append if notes is not None else lambda line: None))
    torch.manual_seed(1)
    model = build_model(cfg).eval()
    load_init_weights(model, cfg.model.init)
    return cfg, model


@pytest.mark.parametrize("legacy_eos", [False, True], ids=["eos-token", "eos-argmax"])
def test_towers_reproduce_the_clipmodel(tmp_path, legacy_eos):
    hf = save_tiny_clip(tmp_path / "clip", legacy_eos=legacy_eos)
    notes = []
    cfg, model = _from_init(tmp_path / "clip", notes=notes)
    assert len(notes) == 1 and "replaces the config's towers" in notes[0] and "\n" not in notes[0]
    v, t = cfg.model.vision, cfg.model.text
    assert (v.kind, v.width, v.layers, v.patch_size, cfg.data.image_size) == ("vit", 32, 2, 8, 32)
    assert (t.width, t.vocab_size, cfg.data.text_length, cfg.model.embed_dim) == (32, 516, 16, 24)
    assert v.hidden_act == t.hidden_act == "quick_gelu" and v.pixel_mean == (0.5, 0.4, 0.3)
    assert t.eos_pooling == ("argmax" if legacy_eos else "token")

    raw = torch.rand(4, 3, 32, 32)
    ids, mask = model.tokenizer(CAPTIONS)
    # the tokenizer is the directory's CLIP BPE: <|startoftext|> ... <|endoftext|>, padded with it
    assert ids[0, 0].item() == 514 and ids[0, -1].item() == 515 and ids[1, :3].tolist() == [514, 320, 515]
    with torch.no_grad():
        ours_i, ours_t = model.encode_image(nclip_pixels(raw)), model.encode_text(ids, mask)
        hf_i = features(hf.get_image_features(pixel_values=hf_pixels(raw)))
        hf_t = features(hf.get_text_features(input_ids=ids, attention_mask=mask))
    torch.testing.assert_close(ours_i["clip"], hf_i, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_t["clip"], hf_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.logit_scale.detach(), hf.logit_scale.detach())
    assert "nclip" in ours_t  # the nCLIP head of xclip is there, freshly initialised

    # ids whose largest id is not the first end-of-text: the two poolings read different positions
    odd = torch.tensor([[514, 40, 515, 300, 515, 515], [514, 513, 60, 515, 515, 515]]).repeat(1, 1)
    odd = torch.cat([odd, torch.full((2, 10), 515)], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(model.encode_text(odd, torch.ones_like(odd))["clip"],
                                   features(hf.get_text_features(input_ids=odd, attention_mask=torch.ones_like(odd))),
                                   rtol=1e-5, atol=1e-5)


def test_hub_names_and_missing_directories_are_one_line_errors(tmp_path, capsys):
    for name in ("openai/clip-vit-base-patch32", str(tmp_path / "nowhere")):
        with pytest.raises(NclipError, match="not a local directory"):
            init_config(validate({"model": {"init": name}}))
    (tmp_path / "empty").mkdir()
    with pytest.raises(NclipError, match="neither a transformers CLIPModel"):
        init_config(validate({"model": {"init": str(tmp_path / "empty")}}))
    assert main(["train", "--preset", "micro", "--init", "openai/clip-vit-base-patch32",
                 "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "downloads nothing" in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_errors_name_the_option_the_directory_came_by(tmp_path, capsys):
    """A CLIPModel nclip cannot reproduce: the same one line under each command, naming the directory
    as the user gave it -- --checkpoint, --init, model.init, or the path alone under nclip.load."""
    save_tiny_clip(tmp_path / "clip")
    config = json.loads((tmp_path / "clip" / "config.json").read_text())
    config["vision_config"]["hidden_act"] = "relu"
    (tmp_path / "clip" / "config.json").write_text(json.dumps(config))
    capsys.readouterr()  # transformers' progress bars
    problem = f"{tmp_path / 'clip'}: vision activation 'relu' is not one of gelu, quick_gelu"
    with pytest.raises(NclipError) as e:
        nclip.load(tmp_path / "clip", device="cpu")
    assert str(e.value) == problem
    runs = {"--checkpoint": ["eval", "--checkpoint", str(tmp_path / "clip"), "--out", str(tmp_path / "ev")],
            "--init": ["train", "--preset", "micro", "--init", str(tmp_path / "clip"), "--out", str(tmp_path / "r1")],
            "model.init": ["train", "--preset", "micro", "--set", f"model.init={tmp_path / 'clip'}",
                           "--out", str(tmp_path / "r2")]}
    for option, argv in runs.items():
        assert main(argv) == 2
        assert capsys.readouterr().err == f"nclip: error: {option} {problem}\n"


def test_init_from_an_nclip_model_and_from_its_hf_export(tmp_path, micro_overrides):
    cfg = resolve("micro", micro_overrides + ["objective.name=clip"])
    torch.manual_seed(0)
    source = build_model(cfg).eval()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(0.02 * torch.randn_like(p))
    save_model(source, cfg, tmp_path / "run" / "model")
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--hf", str(tmp_path / "hf")]) == 0

    pixels = torch.randn(2, 3, cfg.data.image_size, cfg.data.image_size)
    ids, mask = source.tokenizer(CAPTIONS)
    with torch.no_grad():
        want_i, want_t = source.encode_image(pixels)["clip"], source.encode_text(ids, mask)["clip"]
    for init in (tmp_path / "run", tmp_path / "hf"):  # the run directory; the CLIPModel nclip exported
        new_cfg, model = _from_init(init, objective="protoclip")
        assert new_cfg.data.text_length == cfg.data.text_length and new_cfg.model.text.tokenizer is None
        with torch.no_grad():
            torch.testing.assert_close(model.encode_image(pixels)["clip"], want_i, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(model.encode_text(ids, mask)["clip"], want_t, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_training_starts_from_the_clipmodel_and_stands_alone(tmp_path, micro_overrides):
    from nclip.train.loop import train

    hf = save_tiny_clip(tmp_path / "clip")
    overrides = micro_overrides + ["train.steps=2", "train.lr=1e-12", "train.min_lr=0", "train.warmup_steps=0",
                                   "train.checkpoint_every=2", "model.nclip_dim=64",
                                   f"model.init={tmp_path / 'clip'}"]
    result = train(resolve("micro", overrides), tmp_path / "run", progress=False, evaluate=False)
    assert result.steps == 2 and all(torch.isfinite(torch.tensor(v)) for v in result.metrics.values()
                                     if isinstance(v, float))
    assert any(k.startswith("nclip") or "nclip" in k for k in result.metrics), sorted(result.metrics)
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "init: " in saved and "hidden_act: quick_gelu" in saved and "vocab_size: 516" in saved

    (tmp_path / "clip").rename(tmp_path / "gone")  # the run's model loads without the init directory
    model, cfg = load_model(tmp_path / "run" / "model")
    assert cfg.model.init == str(tmp_path / "clip") and cfg.data.image_size == 32
    raw = torch.rand(2, 3, 32, 32)
    ids, mask = model.tokenizer(CAPTIONS)
    with torch.no_grad():  # lr 1e-12: after two steps the weights are still the CLIPModel's
        torch.testing.assert_close(model.encode_image(nclip_pixels(raw))["clip"],
                                   features(hf.get_image_features(pixel_values=hf_pixels(raw))), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(model.encode_text(ids, mask)["clip"],
                                   features(hf.get_text_features(input_ids=ids, attention_mask=mask)),
                                   rtol=1e-4, atol=1e-4)

    # its --hf export carries the CLIPModel's own tokenizer, not the bundled one: transformers gives nclip's ids
    from transformers import AutoTokenizer

    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--hf", str(tmp_path / "hf")]) == 0
    enc = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))(CAPTIONS, padding="max_length", truncation=True,
                                                              return_tensors="pt")
    assert torch.equal(enc["input_ids"], ids) and torch.equal(enc["attention_mask"], mask)


def test_an_hf_export_refuses_a_tokenizer_its_files_cannot_carry(tmp_path, micro_overrides, capsys):
    """CLIP's BPE vocabulary (an OpenCLIP model's): transformers' files would not give its ids, so the export
    refuses in one line and writes nothing (it wrote the bundled WordPiece tokenizer, a BERT one, before)."""
    from nclip.data import clip_bpe

    if clip_bpe.packaged_bpe() is None:
        pytest.skip("CLIP's BPE vocabulary ships with open_clip_torch")
    cfg = resolve("micro", micro_overrides + [f"model.text.tokenizer={clip_bpe.packaged_bpe()}",
                                              "model.text.vocab_size=49408"])
    save_model(build_model(cfg, pretrained_text=False), cfg, tmp_path / "run" / "model")
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "CLIP's BPE vocabulary" in err and "--open-clip or --onnx" in err
    assert not (tmp_path / "hf").exists()
