"""Start from, or evaluate, a local transformers ``SiglipModel`` directory (config.json of model_type
"siglip", model.safetensors or pytorch_model.bin, SigLIP's SentencePiece ``spiece.model``).

SigLIP in nclip's terms (:mod:`nclip.models.siglip_towers`): the image tower is ``kind: vit`` with
``pooling: map`` (no class token, no pre-norm, the attention-pooling head), the text tower
``eos_pooling: last`` (bidirectional, the last position through its Linear head), both with SigLIP's
LayerNorm ε 1e-6. The towers' outputs *are* SigLIP's embeddings, so the CLIP heads (nclip's
``heads.clip.image`` / ``heads.clip.text``, Linear without bias) start as the identity; fine-tuning
trains them from there. The model's ``logit_scale`` s loads exactly -- nclip's cap on s
(``model.logit_scale_max``, ln 100 by default) is lifted to s where s is larger (SigLIP's released
models learned s ≈ 4.76, exp(s) ≈ 117) -- and its ``logit_bias`` b becomes the SigLIP objective's
initial bias (``objective.bias_init``), so logits are exp(s)·cos + b, the model's own.

What nclip cannot express is refused in one line naming the setting: a vision tower without its
attention-pooling head (``vision_use_head: false``), a text ``projection_size`` other than its width,
towers of different widths, a LayerNorm ε other than 1e-6, an activation nclip's towers lack.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from nclip.data.tokenization import SENTENCEPIECE_FILE, CaptionTokenizer
from nclip.data.transforms import PIL_RESAMPLE
from nclip.errors import NclipError, SourceError
from nclip.jsonio import read_json
from nclip.models.hf_weights import (
    PREPROCESSOR,
    SHARD_INDEX,
    copy_weights,
    hf_weights_file,
    read_hf_weights,
    transformer_sizes,
)
from nclip.models.io import CONFIG, WEIGHTS
from nclip.models.siglip_towers import LAYER_NORM_EPS

FORMAT = "transformers SiglipModel"
ACTIVATIONS = ("gelu", "quick_gelu", "gelu_pytorch_tanh")
SCALARS = ("logit_scale", "logit_bias")


def is_siglip_dir(path: Path) -> bool:
    """A transformers SiglipModel directory: a config.json with model_type "siglip"."""
    config = Path(path) / CONFIG
    if not Path(path).is_dir() or not config.is_file():
        return False
    data = read_json(config)
    return isinstance(data, dict) and data.get("model_type") == "siglip"


def architecture(path: Path):
    """(vision, text, data, embed_dim, source) of nclip's config for the SigLIP model in ``path``."""
    from transformers import SiglipConfig
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its default sub-configs warn of their own token ids (CLIP's, not SigLIP's)
    try:
        hf = SiglipConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise SourceError(path, f"cannot read {CONFIG}: {str(e).splitlines()[0]}") from None
    finally:
        hf_logging.set_verbosity(before)
    vc, tc = hf.vision_config, hf.text_config
    if not getattr(vc, "vision_use_head", True):
        raise SourceError(path, "has vision_use_head false: nclip's SigLIP image tower needs its attention-pooling "
                          "head")
    proj = tc.projection_size or tc.hidden_size
    if proj != tc.hidden_size or vc.hidden_size != proj:
        raise SourceError(path, f"text projection_size {proj}, text width {tc.hidden_size} and image width "
                          f"{vc.hidden_size} differ; nclip's SigLIP towers need them equal")
    for name, value in (("image_size", vc.image_size), ("patch_size", vc.patch_size)):
        if not isinstance(value, int):
            raise SourceError(path, f"vision {name} {value!r} is not square (one integer)")
    if getattr(vc, "num_channels", 3) != 3:
        raise SourceError(path, f"vision num_channels {vc.num_channels} is not 3")
    vision = {"kind": "vit", "pooling": "map", "patch_size": vc.patch_size, **_transformer(vc, "vision", path),
              **_pixel_stats(path)}
    text = {"kind": "transformer", "eos_pooling": "last", **_transformer(tc, "text", path), "vocab_size": tc.vocab_size,
            "tokenizer": _tokenizer(path, tc)}
    data = {"image_size": vc.image_size, "text_length": tc.max_position_embeddings, **_eval_resize(path)}
    return vision, text, data, proj, "a transformers SiglipModel"


def _transformer(c, which: str, path: Path) -> dict:
    return transformer_sizes(c, which, ACTIVATIONS, LAYER_NORM_EPS, "nclip's SigLIP towers'", path)


def _preprocessor(path: Path) -> dict:
    data = read_json(path / PREPROCESSOR) if (path / PREPROCESSOR).is_file() else {}
    return data if isinstance(data, dict) else {}


def _pixel_stats(path: Path) -> dict:
    """SigLIP's pixel statistics (0.5, 0.5 where the directory names none: SiglipImageProcessor's)."""
    data = _preprocessor(path)
    mean, std = data.get("image_mean", [0.5] * 3), data.get("image_std", [0.5] * 3)
    return {"pixel_mean": [float(v) for v in mean], "pixel_std": [float(v) for v in std]}


def _eval_resize(path: Path) -> dict:
    """SiglipImageProcessor converts to RGB first (transformers' convention), then resizes to image_size²
    without a crop ("squash"), bicubic by default."""
    resample = _preprocessor(path).get("resample", 3)
    if resample not in PIL_RESAMPLE:
        raise SourceError(path, f"{PREPROCESSOR}: resample {resample!r} is not bicubic (3) or bilinear (2), the "
                          "ones nclip's evaluation offers")
    return {"eval_resize": "squash", "eval_interpolation": PIL_RESAMPLE[resample], "eval_convention": "transformers"}


def _tokenizer(path: Path, tc) -> str:
    if not (path / SENTENCEPIECE_FILE).is_file():
        raise SourceError(path, f"has no {SENTENCEPIECE_FILE} (SigLIP's SentencePiece tokenizer): save the "
                          "tokenizer beside the model")
    tok = CaptionTokenizer(tc.max_position_embeddings, path)
    if tok.vocab_size > tc.vocab_size:
        raise SourceError(path, f"its tokenizer has {tok.vocab_size} tokens, its text tower {tc.vocab_size}")
    return str(path.resolve())


def scale_and_bias(path: Path) -> tuple[float, float]:
    """The model's logit_scale s and logit_bias b (safetensors: those two tensors alone)."""
    found = hf_weights_file(path)
    if found is None:
        raise SourceError(path, f"has no {WEIGHTS} or pytorch_model.bin")
    if found.name in (WEIGHTS, SHARD_INDEX):
        files = ({k: path / v for k, v in read_json(found).get("weight_map", {}).items() if k in SCALARS}
                 if found.name == SHARD_INDEX else dict.fromkeys(SCALARS, found))
        state = {}
        for key, file in files.items():  # a key the shard index does not name: "lacks" below
            try:
                with safe_open(str(file), framework="pt") as f:
                    if key in f.keys():
                        state[key] = f.get_tensor(key)
            except Exception as e:  # safetensors raises its own error types for corrupt files
                raise SourceError(path, f"cannot read {file.name}: {str(e).splitlines()[0]}") from None
    else:
        state = read_hf_weights(path)
    return tuple(_scalar(state, key, path) for key in SCALARS)


def _scalar(state: dict, key: str, path: Path) -> float:
    if key not in state or state[key].numel() != 1:
        raise SourceError(path, f"lacks SigLIP's {key} (one number)")
    value = float(state[key].reshape(()).float())
    if not np.isfinite(value):
        raise SourceError(path, f"{key} is {value}")
    return value


def carry_scalars(raw: dict, path: Path) -> None:
    """Into the run config ``raw`` (a dict): the cap of the logit scale lifted to the model's s where
    that is larger, and b as the initial bias of a SigLIP objective (siglip, xsiglip)."""
    s, b = scale_and_bias(path)
    raw["model"]["logit_scale_max"] = max(float(raw["model"].get("logit_scale_max") or s), s)
    if "bias_init" in type_fields(raw["objective"]["name"]):
        raw["objective"]["bias_init"] = b


def type_fields(objective: str) -> set[str]:
    from nclip.objectives.registry import config_class, is_known

    return set(config_class(objective).model_fields) if is_known(objective) else set()


def load_weights(model, path: Path) -> str:
    """Copy a SiglipModel's towers and logit scale into ``model`` (built from :func:`architecture`'s
    config), the CLIP heads set to the identity; one line saying what was loaded."""
    source = read_hf_weights(path)
    scale = _scalar(source, "logit_scale", path)
    copy_weights(model, source, True, path)  # the towers (a missing or misshapen tensor: one line)
    with torch.no_grad():
        model.logit_scale.fill_(scale)
        for linear in (model.heads["clip"].image, model.heads["clip"].text) if "clip" in model.heads else ():
            if linear.weight.shape[0] != linear.weight.shape[1]:
                raise NclipError(f"SigLIP's embedding is its towers' output: model.embed_dim "
                                 f"{linear.weight.shape[0]} must be the towers' width {linear.weight.shape[1]}")
            linear.weight.copy_(torch.eye(linear.weight.shape[0]))
    return (f"nclip: started from {path}: both SigLIP towers (attention-pool and text heads), its logit scale "
            f"{scale:.4f}; CLIP heads the identity; other heads freshly initialised")
