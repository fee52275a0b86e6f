"""open_clip and OpenAI CLIP reference models for the OpenCLIP/OpenAI import tests: open_clip and
OpenAI's own CLIP code build them here with random weights (nothing downloads), and they are saved in
the forms nclip reads."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import save_file

import nclip  # noqa: F401 (its import makes torchvision importable beside a CPU torch: nclip.torchvision_compat)


def open_clip():
    """The open_clip module."""
    return pytest.importorskip("open_clip")


def openai_clip():
    """OpenAI's CLIP code, ``clip.model`` (clip-anytorch), its torchvision made importable as for open_clip."""
    with warnings.catch_warnings():  # its clip.clip imports setuptools' deprecated pkg_resources
        warnings.simplefilter("ignore")
        return pytest.importorskip("clip.model")


def openai_reference(seed: int = 0, **sizes):
    """OpenAI's ``CLIP(**sizes)`` with random weights (every parameter perturbed, so no bias is zero
    and no ResNet block's last BatchNorm silences it; BatchNorm statistics and the logit scale set),
    rebuilt from its state dict by OpenAI's ``build_model``, as OpenAI's loader does. Returns that
    model in float32 and eval mode, and its state dict as build_model leaves it: OpenAI's release
    precision, fp16 for the convolutions, linear layers and projections."""
    cm = openai_clip()
    torch.manual_seed(seed)
    model = cm.CLIP(**sizes)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
        model.logit_scale.fill_(3.0)
    rebuilt = cm.build_model({k: v.clone() for k, v in model.state_dict().items()})
    state = {k: v.clone().contiguous() for k, v in rebuilt.state_dict().items()}
    return rebuilt.float().eval(), state


def vit_cfg(quick_gelu=False, patch=8, image=32, width=64, layers=2, head_width=32, text_width=64, text_heads=2,
            text_layers=2, embed=32, **vision):
    cfg = {"embed_dim": embed, "vision_cfg": {"image_size": image, "layers": layers, "width": width,
                                              "patch_size": patch, "head_width": head_width, **vision},
           "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": text_width, "heads": text_heads,
                        "layers": text_layers}}
    if quick_gelu:
        cfg["quick_gelu"] = True
    return cfg


def resnet_cfg(layers=(1, 1, 1, 1), width=16, image=64, embed=32, head_width=64):
    return {"embed_dim": embed, "vision_cfg": {"image_size": image, "layers": list(layers), "width": width,
                                               "head_width": head_width},
            "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2}}


def build(cfg: dict, seed: int = 0, custom_text: bool = False):
    """An open_clip CLIP (or CustomTextCLIP) of ``cfg`` with random weights, its BatchNorm statistics
    and logit scale randomised too, in eval mode."""
    oc = open_clip()
    torch.manual_seed(seed)
    cls = oc.model.CustomTextCLIP if custom_text else oc.model.CLIP
    model = cls(**{k: v for k, v in cfg.items() if k != "custom_text"})
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):  # non-trivial statistics and affine maps
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.1)
        model.logit_scale.fill_(3.0)
    return model.eval()


def save_hub(model, cfg: dict, out, preprocess: dict | None = None, fmt: str = "safetensors"):
    """open_clip's hub layout: open_clip_config.json and the weights."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "open_clip_config.json").write_text(json.dumps({"model_cfg": cfg, "preprocess_cfg": preprocess or {}}))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if fmt == "safetensors":
        save_file(state, str(out / "open_clip_model.safetensors"))
    else:
        torch.save(state, out / "open_clip_pytorch_model.bin")
    return out


@torch.no_grad()
def encodings(model, pixels: torch.Tensor, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """open_clip's normalised image and text embeddings (its own tokenizer)."""
    oc = open_clip()
    tokens = oc.tokenizer.SimpleTokenizer()(captions)
    return model.encode_image(pixels, normalize=True), model.encode_text(tokens, normalize=True)
