"""`nclip export --hf` writes a transformers CLIPModel that reproduces nclip's embeddings."""

import torch
from transformers import CLIPModel

from nclip.cli import main
from nclip.config import resolve
from nclip.models import build_model
from nclip.models.io import load_model, save_model


def test_hf_export_round_trip(tmp_path, micro_overrides):
    cfg = resolve("micro", micro_overrides)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    with torch.no_grad():  # move the weights away from their initial values
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    save_model(model, cfg, tmp_path / "run" / "model")

    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--hf", str(tmp_path / "hf")]) == 0
    hf = CLIPModel.from_pretrained(str(tmp_path / "hf")).eval()

    pixels = torch.randn(3, 3, cfg.data.image_size, cfg.data.image_size)
    ids, mask = model.tokenizer(["a red star", "two blue circles left of a green square", "x"])
    with torch.no_grad():
        ours_i = model.encode_image(pixels)["emb"]
        ours_t = model.encode_text(ids, mask)["emb"]
        hf_i = hf.get_image_features(pixel_values=pixels)
        hf_t = hf.get_text_features(input_ids=ids, attention_mask=mask)
    hf_i = getattr(hf_i, "pooler_output", hf_i)
    hf_t = getattr(hf_t, "pooler_output", hf_t)
    torch.testing.assert_close(hf_i, ours_i, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hf_t, ours_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hf.logit_scale.exp(), model.scale().detach())


def test_save_load_round_trip(tmp_path, micro_overrides):
    cfg = resolve("micro", micro_overrides)
    model = build_model(cfg).eval()
    save_model(model, cfg, tmp_path / "m")
    loaded, cfg2 = load_model(tmp_path / "m")
    assert cfg2 == cfg
    for (k, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        torch.testing.assert_close(a, b, msg=k)


def test_export_refuses_models_without_clip_head(tmp_path, micro_overrides, capsys):
    cfg = resolve("micro", micro_overrides + ["objective.name=nclip"])
    save_model(build_model(cfg), cfg, tmp_path / "m")
    assert main(["export", "--checkpoint", str(tmp_path / "m"), "--hf", str(tmp_path / "hf")]) == 2
    assert "CLIP head" in capsys.readouterr().err
