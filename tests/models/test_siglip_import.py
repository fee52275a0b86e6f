"""A transformers SiglipModel directory read by nclip (nclip.models.siglip_import): nclip.load, nclip eval
--checkpoint, and --init of a SigLIP-objective run, against the SiglipModel's own outputs."""

from __future__ import annotations

import json
import math
import pickle
import shutil

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("sentencepiece")

from siglip_fixtures import LOGIT_BIAS, LOGIT_SCALE, TEXT_LENGTH, hf_pixels, save_tiny_siglip  # noqa: E402

from nclip.data.transforms import CLIP_MEAN, CLIP_STD  # noqa: E402

CAPTIONS = ["a photo of a cat", "", "A Red DOG, above the tree!", "Ünïcode café naïve 東京 — “quotes”",
            " ".join(["the small blue bird near the river"] * 6), "two  spaces\tand a tab"]
PROMPTS = ["a photo of a cat", "a drawing of a dog", "the red car", "one large tree"]


@pytest.fixture(scope="module")
def siglip(tmp_path_factory):
    """(directory, SiglipModel, SiglipTokenizer) of the tiny model with safetensors weights."""
    directory = tmp_path_factory.mktemp("siglip") / "model"
    model, tok = save_tiny_siglip(directory)
    return directory, model, tok


def nclip_pixels(raw: torch.Tensor) -> torch.Tensor:
    """raw RGB in [0, 1] → CLIP's normalisation, what nclip's data layer gives its towers."""
    mean, std = torch.from_numpy(CLIP_MEAN).view(1, 3, 1, 1), torch.from_numpy(CLIP_STD).view(1, 3, 1, 1)
    return ((raw - mean) / std).float()


def _hf_text(model, tok, texts):
    ids = tok(texts, padding="max_length", truncation=True, max_length=TEXT_LENGTH, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return ids, F.normalize(model.get_text_features(input_ids=ids).pooler_output, dim=-1)


def _assert_same_embeddings(got, want):
    assert F.cosine_similarity(got, want).min() >= 0.9999
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_load_gives_the_siglip_embeddings(siglip):
    import nclip

    directory, model, tok = siglip
    loaded = nclip.load(directory, device="cpu")
    v, t = loaded.cfg.model.vision, loaded.cfg.model.text
    assert (v.kind, v.pooling, v.hidden_act, t.eos_pooling) == ("vit", "map", "gelu_pytorch_tanh", "last")
    assert loaded.cfg.objective.name == "siglip" and loaded.cfg.data.eval_resize == "squash"
    raw = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = F.normalize(model.get_image_features(pixel_values=hf_pixels(raw)).pooler_output, dim=-1)
    _assert_same_embeddings(loaded.encode_image(nclip_pixels(raw)), want)
    _, want = _hf_text(model, tok, CAPTIONS)
    _assert_same_embeddings(loaded.encode_text(CAPTIONS), want)
    # the text tower attends over the padding as SigLIP does: a padding mask would change the feature
    ids, mask = loaded.tokenizer(CAPTIONS[:1])
    with torch.no_grad():
        masked = model.get_text_features(input_ids=ids, attention_mask=mask).pooler_output
    assert not torch.allclose(F.normalize(masked, dim=-1), want[:1], atol=1e-3)


def test_an_image_size_that_is_no_multiple_of_the_patch(tmp_path):
    import nclip

    model, _ = save_tiny_siglip(tmp_path / "odd", image_size=36)  # 4² patches of 8 px, 4 px dropped
    loaded = nclip.load(tmp_path / "odd", device="cpu")
    assert loaded.cfg.data.image_size == 36
    raw = torch.rand(2, 3, 36, 36, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = F.normalize(model.get_image_features(pixel_values=hf_pixels(raw)).pooler_output, dim=-1)
    _assert_same_embeddings(loaded.encode_image(nclip_pixels(raw)), want)


def test_zero_shot_scores_are_the_models_own_logits(siglip):
    import nclip

    directory, model, tok = siglip
    loaded = nclip.load(directory, device="cpu")
    assert loaded.logit_scale == pytest.approx(math.exp(LOGIT_SCALE), rel=1e-6) and loaded.logit_scale > 100
    assert loaded.logit_bias == pytest.approx(LOGIT_BIAS, abs=1e-6)
    raw = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    ids, _ = _hf_text(model, tok, PROMPTS)
    with torch.no_grad():
        want = model(input_ids=ids, pixel_values=hf_pixels(raw)).logits_per_image  # [3, 4]
    scores = loaded.zero_shot(nclip_pixels(raw), PROMPTS, templates=["{}"])
    torch.testing.assert_close(scores, want, rtol=0, atol=1e-4)
    image, text = loaded.encode_image(nclip_pixels(raw)), loaded.encode_text(PROMPTS)
    torch.testing.assert_close(loaded.logits(image, text), want, rtol=0, atol=1e-4)
    torch.testing.assert_close(loaded.probabilities(image, text), want.sigmoid(), rtol=0, atol=1e-5)


def test_token_ids_are_the_siglip_tokenizers(siglip):
    from nclip.data.tokenization import CaptionTokenizer

    directory, _, tok = siglip
    ours = CaptionTokenizer(TEXT_LENGTH, directory)
    ids, mask = ours(CAPTIONS)
    want = tok(CAPTIONS, padding="max_length", truncation=True, max_length=TEXT_LENGTH)
    assert ids.tolist() == want["input_ids"] and mask.tolist() == want["attention_mask"]
    assert ids[1, 0] == tok.eos_token_id and ids[4, -1] == tok.eos_token_id  # empty; truncated keeps its </s>
    assert (ours.pad_id, ours.eos_id, ours.vocab_size) == (tok.pad_token_id, tok.eos_token_id, len(tok))
    assert pickle.loads(pickle.dumps(ours))(CAPTIONS)[0].tolist() == ids.tolist()  # to the loader's workers


def test_pytorch_model_bin_loads_the_same_model(tmp_path, siglip):
    import nclip

    directory, _, _ = siglip
    save_tiny_siglip(tmp_path / "bin", bin_weights=True)  # the same seed: the same weights
    assert (tmp_path / "bin" / "pytorch_model.bin").is_file() and not (tmp_path / "bin" / "model.safetensors").exists()
    got, want = nclip.load(tmp_path / "bin", device="cpu"), nclip.load(directory, device="cpu")
    pixels = nclip_pixels(torch.rand(2, 3, 32, 32))
    assert torch.equal(got.encode_image(pixels), want.encode_image(pixels))
    assert torch.equal(got.encode_text(CAPTIONS), want.encode_text(CAPTIONS))
    assert got.logit_bias == want.logit_bias and got.logit_scale == want.logit_scale


def test_nclip_eval_reads_a_siglip_directory(tmp_path, siglip, capsys):
    from nclip.cli import main

    directory, _, _ = siglip
    assert main(["eval", "--checkpoint", str(directory), "--out", str(tmp_path / "ev"), "--tasks", "zeroshot",
                 "--dataset", "synthetic", "--samples", "16", "--no-report", "--no-cache"]) == 0
    doc = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert doc["checkpoint"]["format"] == "transformers SiglipModel", doc["checkpoint"]
    assert any(k.startswith("zeroshot/") for k in doc["results"])


def _edit_config(directory, section, key, value):
    path = directory / "config.json"
    data = json.loads(path.read_text())
    (data[section] if section else data)[key] = value
    path.write_text(json.dumps(data))


def _drop_bias(directory):
    from safetensors.torch import load_file, save_file

    state = load_file(str(directory / "model.safetensors"))
    del state["logit_bias"]
    save_file(state, str(directory / "model.safetensors"))


BROKEN = [  # (what, how to break a copy of the directory, words the one line must hold)
    ("no attention-pool head", lambda d: _edit_config(d, "vision_config", "vision_use_head", False), "vision_use_head"),
    ("CLIP's LayerNorm eps", lambda d: _edit_config(d, "text_config", "layer_norm_eps", 1e-5), "layer_norm_eps"),
    ("another activation", lambda d: _edit_config(d, "vision_config", "hidden_act", "relu"), "activation"),
    ("projection != width", lambda d: _edit_config(d, "text_config", "projection_size", 16), "projection_size"),
    ("shapes differ", lambda d: _edit_config(d, "vision_config", "intermediate_size", 96), "has shape"),
    ("no tokenizer", lambda d: (d / "spiece.model").unlink(), "spiece.model"),
    ("corrupt tokenizer", lambda d: (d / "spiece.model").write_bytes(b"not a model"), "SentencePiece"),
    ("corrupt safetensors", lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 64), "cannot read"),
    ("no weights", lambda d: (d / "model.safetensors").unlink(), "missing weights"),
    ("no logit bias", _drop_bias, "lacks SigLIP's logit_bias"),
]


@pytest.mark.parametrize("what,breaks,words", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_directories_are_one_line_errors(tmp_path, siglip, capsys, what, breaks, words):
    from nclip.cli import main

    broken = tmp_path / "broken"
    shutil.copytree(siglip[0], broken)
    breaks(broken)
    assert main(["eval", "--checkpoint", str(broken), "--out", str(tmp_path / "ev")]) == 2
    _assert_one_error_line(capsys.readouterr().err, words)


def _assert_one_error_line(err: str, words: str) -> None:
    """One ``nclip: error:`` line holding ``words``, last (weights are read once the evaluation has
    said what it extracts: that progress line may come first), and no traceback."""
    lines = err.splitlines()
    assert "Traceback" not in err and lines[-1].startswith("nclip: error:") and words in lines[-1], err
    assert sum("error" in line for line in lines) == 1 and len(lines) <= 2, err


def test_a_corrupt_pytorch_model_bin_is_one_line(tmp_path, capsys):
    from nclip.cli import main

    save_tiny_siglip(tmp_path / "bin", bin_weights=True)
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not a zip")
    capsys.readouterr()  # transformers' progress bar of the save
    assert main(["eval", "--checkpoint", str(tmp_path / "bin"), "--out", str(tmp_path / "ev")]) == 2
    _assert_one_error_line(capsys.readouterr().err, "weights_only")


@pytest.mark.slow
def test_siglip_training_starts_from_the_models_scale_and_bias(tmp_path, siglip, micro_overrides, capsys):
    from nclip.cli import main
    from nclip.train.checkpoint import read_checkpoint

    directory = tmp_path / "siglip"
    shutil.copytree(siglip[0], directory)
    overrides = micro_overrides + ["train.steps=2", "train.log_every=1", "train.checkpoint_every=1",
                                   "train.warmup_steps=0", "train.lr=1e-2", "objective.name=siglip"]
    args = ["train", "--preset", "micro", "--init", str(directory), "--out", str(tmp_path / "run"), "--no-progress",
            "--no-eval"]
    for item in overrides:
        args += ["--set", item]
    assert main(args) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first, second = rows[0], rows[1]
    # the first step's forward ran with the model's own t = exp(s) and b: the objective's state at step 0
    assert first["step"] == 1 and first["logit_scale"] == pytest.approx(math.exp(LOGIT_SCALE), rel=1e-6)
    assert first["siglip/logit_bias"] == pytest.approx(LOGIT_BIAS, abs=1e-6)
    assert math.isfinite(first["loss"]) and math.isfinite(second["loss"])
    # and it trains: the bias (the objective's) and the scale moved after the first step
    weights, state = read_checkpoint(tmp_path / "run" / "checkpoints" / "step_00000001")
    assert float(state["objective"]["logit_bias"]) != pytest.approx(LOGIT_BIAS, abs=1e-6)
    assert second["siglip/logit_bias"] == pytest.approx(float(state["objective"]["logit_bias"]), abs=1e-6)
    assert float(weights["logit_scale"]) != pytest.approx(LOGIT_SCALE, abs=1e-6)
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert f"logit_scale_max: {float(torch.tensor(LOGIT_SCALE))}" in saved and "pooling: map" in saved
    directory.rename(tmp_path / "gone")  # the run stands alone: its model/ keeps the SentencePiece tokenizer
    import nclip

    loaded = nclip.load(tmp_path / "run", device="cpu")
    assert loaded.tokenizer(CAPTIONS)[0].tolist() == siglip[2](CAPTIONS, padding="max_length", truncation=True,
                                                               max_length=TEXT_LENGTH)["input_ids"]
    assert loaded.logit_bias is None and loaded.model.LOGIT_SCALE_MAX > math.log(100)
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "SigLIP tower" in err, err


def test_attention_maps_are_the_pooling_probes(siglip):
    import nclip

    loaded = nclip.load(siglip[0], device="cpu")
    maps = loaded.model.vision.attention_maps(nclip_pixels(torch.rand(2, 3, 32, 32)))
    assert maps.shape == (2, 2, 4, 4)  # [B, heads, h, w]: 32 px / patch 8
    torch.testing.assert_close(maps.sum(dim=(-2, -1)), torch.ones(2, 2))  # no class token: all on the patches


def test_the_attention_pool_needs_a_vit_without_patch_dropout():
    from nclip.config import validate

    for bad in ({"kind": "resnet", "pooling": "map"}, {"pooling": "map", "patch_dropout": 0.5}):
        with pytest.raises(Exception, match="pooling map needs kind vit"):
            validate({"model": {"vision": bad}})


@pytest.mark.parametrize("objective", ["siglip", "xsiglip", "clip"])
def test_init_config_carries_scale_cap_and_bias(siglip, objective):
    from nclip.config import validate
    from nclip.models.dual_encoder import build_model
    from nclip.models.hf_import import init_config, load_init_weights

    notes = []
    cfg = init_config(validate({"model": {"init": str(siglip[0])}, "objective": {"name": objective}}),
                      note=notes.append)
    assert "a transformers SiglipModel" in notes[0]
    assert cfg.model.logit_scale_max == float(torch.tensor(LOGIT_SCALE)) > math.log(100)
    if objective == "clip":
        assert "bias_init" not in type(cfg.objective).model_fields
    else:
        assert cfg.objective.bias_init == pytest.approx(LOGIT_BIAS, abs=1e-6)
    model = build_model(cfg)
    load_init_weights(model, cfg.model.init)
    assert float(model.scale().detach()) == pytest.approx(math.exp(LOGIT_SCALE), rel=1e-6)  # not cut to 100
    assert torch.equal(model.heads["clip"].text.weight, torch.eye(32))
