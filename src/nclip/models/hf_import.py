"""Start from a pretrained model (``model.init``): a local transformers ``CLIPModel`` directory (what
``CLIPModel.save_pretrained`` and ``nclip export --hf`` write), a ``SiglipModel`` directory
(:mod:`nclip.models.siglip_import`), an nclip run/model directory, or an
OpenCLIP/OpenAI checkpoint (:mod:`nclip.models.openclip_files`: an open_clip directory, a state dict
with ``model.init_arch`` or in OpenAI's layout, OpenAI's TorchScript archive; renamed by
:mod:`nclip.models.openclip_import`).

Two steps. :func:`init_config` gives the run config the pretrained model's architecture (towers,
image size, text length, vocabulary, tokenizer, pixel statistics, CLIP head width), replacing the
preset's; :func:`load_init_weights` copies the towers and, where the shapes match, the CLIP head
and logit scale into a freshly built model, whose other heads (nCLIP, ProtoCLIP, ...) keep their
usual initialisation. The inverse of :mod:`nclip.models.export_transformers`: nclip's ViT and text
tower *are* transformers' CLIPVisionModel / CLIPTextModel, so the weights are a renaming.

Nothing downloads: anything but an existing local directory (a hub name such as
``openai/clip-vit-base-patch32``) is a one-line error. Weights are read from safetensors, or from a
CLIPModel's ``pytorch_model.bin`` with ``torch.load(weights_only=True)`` (:mod:`nclip.models.hf_weights`).

Errors about the model's files are :class:`~nclip.errors.SourceError`: they name the path, and the
caller names the option it came by (``model.init`` in a run, ``--checkpoint`` in an evaluation).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from nclip.config import RunConfig, validate
from nclip.data.tokenization import TOKENIZER_FILE, CaptionTokenizer
from nclip.data.transforms import CLIP_MEAN, CLIP_STD, PIL_RESAMPLE
from nclip.errors import SourceError
from nclip.jsonio import read_json
from nclip.models import openclip_files, openclip_import, siglip_import
from nclip.models.hf_weights import (  # noqa: F401 (PT_WEIGHTS, hf_weights_file, copy_weights: re-exported)
    PREPROCESSOR,
    PT_WEIGHTS,
    copy_weights,
    hf_weights_file,
    read_hf_weights,
    transformer_sizes,
)
from nclip.models.io import CONFIG, WEIGHTS, read_config, read_weights
from nclip.models.lora import base_layers

ACTIVATIONS = ("gelu", "quick_gelu")  # the ones nclip's config offers


def init_dir(value: str | Path, arch: str | None = None) -> Path:
    """``value`` as an existing local directory, or a local OpenCLIP/OpenAI weights file (a state
    dict or TorchScript archive; any file with ``arch``); anything else is an error (nothing downloads)."""
    path = Path(value).expanduser()
    if path.is_file() and openclip_files.is_openclip(path, arch):
        return path
    if path.is_file():
        what = ("an nclip model's weights: give its directory" if path.name == WEIGHTS else
                f"neither a weights file ({', '.join(openclip_files.WEIGHT_SUFFIXES)}) nor a model directory")
        raise SourceError(value, f"is {what}")
    if not path.is_dir():
        raise SourceError(value, "is not a local directory or file (nclip downloads nothing: give the directory "
                          "CLIPModel.save_pretrained, open_clip or nclip export --hf wrote, a weights file, or an "
                          "nclip run)")
    return path


def is_hf_clip_dir(path: Path) -> bool:
    """A transformers CLIPModel directory: a config.json with model_type "clip"."""
    config = Path(path) / CONFIG
    if not config.is_file():
        return False
    data = read_json(config)
    return isinstance(data, dict) and data.get("model_type") == "clip"


def _nclip_model_dir(path: Path) -> Path:
    for candidate in (path, path / "model"):
        if (candidate / CONFIG).is_file() and (candidate / WEIGHTS).is_file():
            return candidate
    raise SourceError(path, f"holds neither a transformers CLIPModel or SiglipModel (config.json with model_type "
                      f"clip or siglip) nor an nclip model ({CONFIG} and {WEIGHTS}, or model/ with them)")


# ---------------------------------------------------------------------------------------------
# the architecture
# ---------------------------------------------------------------------------------------------


def init_config(cfg: RunConfig, required: bool = True, note=None, warn=None) -> RunConfig:
    """``cfg`` with the architecture of ``cfg.model.init`` (unchanged without one). ``required``
    False (resuming a run, whose config already holds the architecture) tolerates a vanished
    directory. ``note(line)`` gets one line saying what was taken (default: stderr), ``warn(line)`` one
    saying what was assumed where the checkpoint does not say (default: ``note``)."""
    if cfg.model.init is None or (not required and not Path(cfg.model.init).expanduser().exists()):
        return cfg
    arch = cfg.model.init_arch
    path = init_dir(cfg.model.init, arch)
    siglip = siglip_import.is_siglip_dir(path)
    if openclip_files.is_openclip(path, arch):
        vision, text, data, embed_dim, source = _openclip_architecture(path, arch, warn or note or _stderr)
    elif siglip:
        vision, text, data, embed_dim, source = siglip_import.architecture(path)
    elif is_hf_clip_dir(path):
        vision, text, data, embed_dim, source = _hf_architecture(path)
    else:
        vision, text, data, embed_dim, source = _nclip_architecture(path)
    raw = cfg.model_dump(mode="json")
    for section, arch in (("vision", vision), ("text", text)):  # locking is the run's, not the architecture's
        arch.update({k: raw["model"][section][k] for k in ("lock", "unlocked_layers")})
    raw["model"].update(vision=vision, text=text, embed_dim=embed_dim)
    raw["data"].update(data)
    if siglip:  # its logit scale kept exactly (the cap lifted), its bias the SigLIP objective's start
        siglip_import.carry_scalars(raw, path)
    out = validate(raw)
    v, t = out.model.vision, out.model.text
    line = (f"nclip: model.init {path} ({source}): its architecture replaces the config's towers -- image "
            f"{v.kind} width {v.width}, {v.layers} layers, {v.heads} heads, patch {v.patch_size}, "
            f"{out.data.image_size} px; text width {t.width}, {t.layers} layers, {out.data.text_length} tokens; "
            f"CLIP head {out.model.embed_dim}")
    (note or _stderr)(line)
    return out


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _openclip_architecture(path: Path, arch: str | None, warn):
    src = openclip_files.source(path, arch)
    weights = openclip_files.read_weights(src) if path.is_file() else None  # a hub directory's config decides
    vision, text, data, embed_dim = openclip_import.architecture(src, openclip_import.model_config(src, weights))
    if src.model_cfg is None and weights.origin != openclip_files.OPENAI:  # nothing in the file says whose it is
        warn(f"nclip: {path}: no --arch, so its architecture is read from its tensors as OpenAI's CLIP reads it, "
             "with QuickGELU like all of OpenAI's models (weights open_clip trained with GELU need --arch NAME)")
    return vision, text, data, embed_dim, src.form


def _hf_architecture(path: Path):
    from transformers import CLIPConfig

    try:
        hf = CLIPConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise SourceError(path, f"cannot read {CONFIG}: {str(e).splitlines()[0]}") from None
    vc, tc = hf.vision_config, hf.text_config
    vision = {"kind": "vit", "patch_size": vc.patch_size, **_transformer(vc, "vision", path), **_pixel_stats(path)}
    length = tc.max_position_embeddings
    # transformers' CLIPTextModel pools the largest id for the eos_token_id 2 of old configs (OpenAI's)
    pooling = "argmax" if tc.eos_token_id == 2 else "token"
    text = {"kind": "transformer", **_transformer(tc, "text", path), "vocab_size": tc.vocab_size,
            "eos_pooling": pooling, "tokenizer": _hf_tokenizer(path, length, tc, pooling)}
    data = {"image_size": vc.image_size, "text_length": length, **_hf_preprocess(path)}
    return vision, text, data, hf.projection_dim, "a transformers CLIPModel"


def _transformer(c, which: str, path: Path) -> dict:
    return transformer_sizes(c, which, ACTIVATIONS, 1e-5, "nclip's", path)


def _pixel_stats(path: Path) -> dict:
    """pixel_mean/std from a preprocessor_config.json where it has statistics other than CLIP's."""
    if not (path / PREPROCESSOR).is_file():
        return {}
    data = read_json(path / PREPROCESSOR)
    mean, std = data.get("image_mean"), data.get("image_std")
    if mean is None or std is None or (np.allclose(mean, CLIP_MEAN, atol=1e-6)
                                       and np.allclose(std, CLIP_STD, atol=1e-6)):
        return {}
    return {"pixel_mean": list(mean), "pixel_std": list(std)}


def _hf_preprocess(path: Path) -> dict:
    """CLIPImageProcessor's pixels: its conversion and crop (data.eval_convention), its resample, and
    whether it resizes both sides (a size of height and width, not shortest_edge: "squash")."""
    data = read_json(path / PREPROCESSOR) if (path / PREPROCESSOR).is_file() else {}
    resample, size = data.get("resample", 3), data.get("size")
    if resample not in PIL_RESAMPLE:
        raise SourceError(path, f"{PREPROCESSOR}: resample {resample!r} is not bicubic (3) or bilinear (2), the "
                          "ones nclip's evaluation offers")
    squash = isinstance(size, dict) and "shortest_edge" not in size and {"height", "width"} <= set(size)
    return {"eval_convention": "transformers", "eval_interpolation": PIL_RESAMPLE[resample],
            "eval_resize": "squash" if squash else "shortest"}


def _hf_tokenizer(path: Path, length: int, tc, pooling: str) -> str | None:
    """The directory's tokenizer (its path), or None for the bundled WordPiece one where the
    directory has none, or one with the bundled vocabulary and special tokens (an nclip export), and
    the text tower was trained with it."""
    if (path / TOKENIZER_FILE).is_file():
        tok, chosen = CaptionTokenizer(length, path), str(path.resolve())
        if tok.same_vocabulary(CaptionTokenizer(length)):
            chosen = None  # nothing to copy into the run: the bundled tokenizer gives the same ids
    else:
        tok, chosen = CaptionTokenizer(length), None
        if tok.vocab_size != tc.vocab_size:
            raise SourceError(path, f"has no {TOKENIZER_FILE} and its vocabulary ({tc.vocab_size}) is not the "
                              f"bundled tokenizer's ({tok.vocab_size}): save the tokenizer beside the model")
    if tok.vocab_size > tc.vocab_size:
        raise SourceError(path, f"its tokenizer has {tok.vocab_size} tokens, its text tower {tc.vocab_size}")
    if pooling == "token" and tok.eos_id != tc.eos_token_id:
        raise SourceError(path, f"its tokenizer's end-of-text id {tok.eos_id} is not the text tower's "
                          f"eos_token_id {tc.eos_token_id}")
    return chosen


def _nclip_architecture(path: Path):
    src = read_config(_nclip_model_dir(path))
    data = {k: getattr(src.data, k) for k in ("image_size", "text_length", "eval_resize", "eval_interpolation",
                                                 "eval_convention")}
    m = src.model.model_dump(mode="json")
    return m["vision"], m["text"], data, m["embed_dim"], "an nclip model"


# ---------------------------------------------------------------------------------------------
# the weights
# ---------------------------------------------------------------------------------------------


def load_init_weights(model, init: str | Path, arch: str | None = None) -> str:
    """Copy the towers and, where the shapes match, the CLIP head and logit scale of ``init`` into
    ``model`` (built from :func:`init_config`'s config); returns one line saying what was loaded.
    A model with LoRA gets them in the layers its adapters wrap."""
    with base_layers(model):
        return _load_init_weights(model, init, arch)


def _load_init_weights(model, init: str | Path, arch: str | None) -> str:
    path = init_dir(init, arch)
    hf = True
    if siglip_import.is_siglip_dir(path):
        return siglip_import.load_weights(model, path)
    if openclip_files.is_openclip(path, arch):  # renamed to a CLIPModel's names (the modified ResNet: nclip's)
        src = openclip_files.source(path, arch)
        names: dict[str, str] = {}
        source = openclip_import.transformers_names(openclip_files.read_weights(src).state, model.vision.width, names)
        return copy_weights(model, source, True, path, names, _built_from(src))
    if is_hf_clip_dir(path):
        source = read_hf_weights(path)
    else:
        hf, source = False, read_weights(_nclip_model_dir(path) / WEIGHTS)
    return copy_weights(model, source, hf, path)


def _built_from(src) -> str:
    """What an OpenCLIP/OpenAI model's architecture came from, in words."""
    if src.arch is not None:
        return f"--arch {src.arch}"
    if src.model_cfg is not None:
        return f"its {openclip_files.HUB_CONFIG}"
    return "OpenAI's CLIP of the sizes its tensors say"
