"""`nclip export --hf` writes a transformers CLIPModel that reproduces nclip's embeddings."""

import numpy as np
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
        ours_i = model.encode_image(pixels)["clip"]
        ours_t = model.encode_text(ids, mask)["clip"]
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


def test_hf_export_asks_the_zero_shot_score(tmp_path, micro_overrides, monkeypatch, capsys):
    """A CLIPModel scores by the cosine of the CLIP head: a model that nclip scores zero-shot
    otherwise (a plugin's own score beside a CLIP head) is refused in one line, as its export would
    not predict as nclip eval does."""
    from dataclasses import replace

    import nclip.objectives
    from nclip.objectives.scores import NclipScore

    cfg = resolve("micro", micro_overrides)  # xclip: CLIP and nCLIP heads, scored by CLIP's cosine
    save_model(build_model(cfg), cfg, tmp_path / "m")
    plan = nclip.objectives.plan_for
    monkeypatch.setattr(nclip.objectives, "plan_for", lambda run_cfg: replace(plan(run_cfg), zero_shot=NclipScore()))
    assert main(["export", "--checkpoint", str(tmp_path / "m"), "--hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "transfers zero-shot with the 'nclip' score (nclip head)" in err, err
    assert not (tmp_path / "hf").exists()


def test_hf_export_with_auto_classes_matches_nclip_load(tmp_path, micro_overrides):
    """AutoTokenizer + AutoImageProcessor + CLIPModel alone, from the exported directory, give
    nclip.load's CLIP-head embeddings for the same images and captions."""
    import numpy as np
    import torch.nn.functional as F
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer

    import nclip

    cfg = resolve("micro", micro_overrides)
    torch.manual_seed(0)
    model = build_model(cfg, pretrained_text=False).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    save_model(model, cfg, tmp_path / "run" / "model")
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--hf", str(tmp_path / "hf")]) == 0
    ours = nclip.load(tmp_path / "run", device="cpu")

    hf_dir = str(tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(hf_dir)
    # PIL's resize, as nclip's: where torchvision is installed (the dev extra, for open_clip), transformers
    # 5 picks its torchvision backend, whose bicubic resize differs by up to 0.015 on these images
    proc = AutoImageProcessor.from_pretrained(hf_dir, backend="pil")
    hf = CLIPModel.from_pretrained(hf_dir).eval()

    captions = ["a red star", "Two BLUE circles, left of a green square " * 4, "x"]  # one truncated
    enc = tok(captions, padding="max_length", truncation=True, return_tensors="pt")
    ids, mask = ours.tokenizer(captions)
    assert torch.equal(enc["input_ids"], ids) and torch.equal(enc["attention_mask"], mask)
    # tokenizers alone, from the exported file as it is: padded and truncated to the model's text length
    from tokenizers import Tokenizer

    plain = Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json")).encode_batch(captions)
    assert torch.equal(torch.tensor([e.ids for e in plain]), ids)
    assert torch.equal(torch.tensor([e.attention_mask for e in plain]), mask)

    rng = np.random.default_rng(0)
    # square, larger, and non-square ones whose long side S * long / short has a fraction >= 0.5
    # (16 * 37 / 20 = 29.6: truncated to 29, as transformers and torchvision size it)
    images = [Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8))
              for shape in ((16, 16, 3), (40, 40, 3), (20, 37, 3), (37, 20, 3), (48, 64, 3))]
    pixels = proc(images=images, return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(pixels, torch.stack([ours.transform(im) for im in images]), rtol=0, atol=1e-5)

    with torch.no_grad():
        hf_i = hf.get_image_features(pixel_values=pixels)
        hf_t = hf.get_text_features(**enc)
    hf_i = F.normalize(getattr(hf_i, "pooler_output", hf_i), dim=-1)
    hf_t = F.normalize(getattr(hf_t, "pooler_output", hf_t), dim=-1)
    assert (hf_i * ours.encode_image(images)).sum(-1).min() >= 0.9999
    assert (hf_t * ours.encode_text(captions)).sum(-1).min() >= 0.9999

    # the export loaded back takes CLIPImageProcessor's pixels exactly, also where transformers' crop and
    # conversion are not torchvision's (nclip's own convention): a 3 (mod 4) overhang, an RGBA image
    back = nclip.load(hf_dir, device="cpu")
    assert back.cfg.data.eval_convention == "transformers" and ours.cfg.data.eval_convention == "torchvision"
    odd = [Image.fromarray(rng.integers(0, 256, (32, 38, 3), dtype=np.uint8)),
           Image.fromarray(rng.integers(0, 256, (20, 37, 4), dtype=np.uint8))]
    pixels = proc(images=odd, return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(pixels, torch.stack([back.transform(im) for im in odd]), rtol=0, atol=1e-6)
    assert (pixels - torch.stack([ours.transform(im) for im in odd])).abs().amax((1, 2, 3)).min() > 0.1


def test_hf_export_processor_keeps_the_runs_resize_and_resample(tmp_path, micro_overrides):
    """A squash/bilinear run's image processor resizes both sides with PIL's bilinear (it was the shorter side
    bicubic and a crop for every run): its pixels are the exported model's own, loaded back."""
    from PIL import Image
    from transformers import AutoImageProcessor

    import nclip

    cfg = resolve("micro", micro_overrides + ["data.eval_resize=squash", "data.eval_interpolation=bilinear"])
    save_model(build_model(cfg, pretrained_text=False), cfg, tmp_path / "run" / "model")
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--hf", str(tmp_path / "hf")]) == 0
    proc = AutoImageProcessor.from_pretrained(str(tmp_path / "hf"), backend="pil")
    back = nclip.load(tmp_path / "hf", device="cpu")
    assert (back.cfg.data.eval_resize, back.cfg.data.eval_interpolation) == ("squash", "bilinear")
    images = [Image.fromarray(np.random.default_rng(i).integers(0, 256, (23 + 9 * i, 41, 3), dtype=np.uint8))
              for i in range(3)]
    pixels = proc(images=images, return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(pixels, torch.stack([back.transform(im) for im in images]), rtol=0, atol=1e-6)
