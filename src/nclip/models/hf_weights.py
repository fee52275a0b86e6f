"""The weights of a transformers directory (model.safetensors, its shards, pytorch_model.bin or its
shards) and their copy into nclip's towers, CLIP head and logit scale by transformers' names: shared by
the CLIPModel (:mod:`nclip.models.hf_import`), OpenCLIP and SiglipModel (:mod:`nclip.models.siglip_import`)
imports. ``pytorch_model.bin`` is read with ``torch.load(weights_only=True)``, which unpickles tensors
and plain containers only.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from nclip.errors import SourceError
from nclip.heads.builtin import ClipHead
from nclip.jsonio import read_json
from nclip.models.io import CONFIG, WEIGHTS

PREPROCESSOR = "preprocessor_config.json"  # an image processor's settings (mean, std, resample)
SHARD_INDEX = "model.safetensors.index.json"
PT_WEIGHTS = "pytorch_model.bin"  # transformers' pickled weights, read with torch.load(weights_only=True)
PT_SHARD_INDEX = "pytorch_model.bin.index.json"
# nclip tower prefix in the model's state dict → CLIPModel's prefix
HF_TOWERS = {"vision.model.": "vision_model.", "text.model.": "text_model."}
# the CLIP head: nclip key → CLIPModel key (loaded where the model has it and the shapes match)
HF_HEAD = {**{f"heads.clip.{side}.weight": f"{name}.weight" for side, name in ClipHead.hf_names.items()},
           "logit_scale": "logit_scale"}
NCLIP_TOWERS = ("vision.", "text.")


def copy_weights(model, source: dict[str, torch.Tensor], hf: bool, path: Path, names: dict[str, str] | None = None,
                 built: str = f"its {CONFIG}") -> str:
    """Copy ``source`` -- a CLIPModel's tensors by its names (``hf``; a modified ResNet's under nclip's
    own ``vision.*`` names) or an nclip model's -- into ``model``'s towers, CLIP head and logit scale.
    ``names``: the name in ``path`` of each renamed tensor (an open_clip file's), for messages, which
    say that ``built`` (what the model was built from) wants another shape."""
    own = model.state_dict()
    towers, heads = {}, {}
    native = any(k.startswith("vision.") for k in source)  # the modified ResNet under nclip's own names
    for key in own:
        src = key if native and key.startswith("vision.") else _tower_key(key, hf)
        if src is not None:
            towers[key] = src
        elif key in HF_HEAD:
            heads[key] = HF_HEAD[key] if hf else key
    state, missing = {}, []
    for key, src in towers.items():
        if src not in source:
            if not key.endswith("position_ids"):  # a buffer some transformers versions do not save
                missing.append(src)
            continue
        if source[src].shape != own[key].shape:
            raise SourceError(path, f"{(names or {}).get(src, src)} has shape {tuple(source[src].shape)}, where "
                              f"{built} has {tuple(own[key].shape)}")
        state[key] = source[src]
    if missing:  # a renamed file's names for them are not known: no renamed names
        which = "" if names is not None else f" {missing[:3]}"
        raise SourceError(path, f"lacks {len(missing)} of the {len(towers)} tower weights of {built}{which}")
    loaded_heads = [k for k, src in heads.items() if src in source and source[src].shape == own[k].shape]
    state.update({k: source[heads[k]] for k in loaded_heads})
    model.load_state_dict(state, strict=False)
    for name, tower in model.towers().items():  # the copies heads hold (CMSF's target) start as the image tower
        if name not in ("vision", "text"):
            tower.load_state_dict(model.vision.state_dict())
    head = "the CLIP head and logit scale" if len(loaded_heads) == len(HF_HEAD) else (
        f"{', '.join(loaded_heads)} of the CLIP head" if loaded_heads else "no CLIP head")
    return f"nclip: started from {path}: both towers and {head}; other heads freshly initialised"


def _tower_key(key: str, hf: bool) -> str | None:
    """The source's name for a tower tensor of the model (None: not a tower tensor)."""
    if not hf:
        return key if key.startswith(NCLIP_TOWERS) else None
    for ours, theirs in HF_TOWERS.items():
        if key.startswith(ours):
            sub = key[len(ours):]  # CLIPVisionModel names it with or without vision_model., by version
            return sub if sub.startswith(theirs) else theirs + sub
    return None


def hf_weights_file(directory: Path) -> Path | None:
    """The file that names a transformers directory's weights: model.safetensors, its shard index,
    pytorch_model.bin or its shard index (in that order of preference); None: none of them."""
    for name in (WEIGHTS, SHARD_INDEX, PT_WEIGHTS, PT_SHARD_INDEX):
        if (directory / name).is_file():
            return directory / name
    return None


def read_hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    """A transformers directory's tensors: safetensors where it has them, else pytorch_model.bin
    (or its shards) through ``torch.load(weights_only=True)``, which unpickles tensors and plain
    containers only."""
    found = hf_weights_file(directory)
    if found is None or found.name in (WEIGHTS, SHARD_INDEX):
        return read_safetensors(directory)
    files = [PT_WEIGHTS] if found.name == PT_WEIGHTS else sorted(set(read_json(found).get("weight_map", {}).values()))
    state = {}
    for name in files:
        try:
            part = torch.load(str(directory / name), map_location="cpu", weights_only=True)
        except Exception as e:  # pickle, zip and weights_only errors alike
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise SourceError(directory, f"cannot read {name} (torch.load, weights_only=True): {first}") from None
        if not isinstance(part, dict):
            raise SourceError(directory, f"{name} holds a {type(part).__name__}, not a state dict")
        state.update({k: v for k, v in part.items() if isinstance(v, torch.Tensor)})
    return state


def read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    """The tensors of ``directory``/model.safetensors, or of the shards its index names."""
    if (directory / SHARD_INDEX).is_file():
        files = sorted(set(read_json(directory / SHARD_INDEX).get("weight_map", {}).values()))
    elif (directory / WEIGHTS).is_file():
        files = [WEIGHTS]
    else:
        raise SourceError(directory, f"has no {WEIGHTS}")
    state = {}
    for name in files:
        try:
            state.update(load_file(str(directory / name), device="cpu"))
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise SourceError(directory, f"cannot read {name}: {str(e).splitlines()[0]}") from None
    return state


def transformer_sizes(c, which: str, activations: tuple[str, ...], layer_norm_eps: float, whose: str,
                      path: Path) -> dict:
    """width, layers, heads, mlp_ratio, activation of a transformers tower config (CLIP's or SigLIP's)
    of the model at ``path``; an error for what nclip's towers (``whose``, with ``activations`` and
    ``layer_norm_eps``) cannot reproduce."""
    ratio = c.intermediate_size / c.hidden_size
    if int(c.hidden_size * ratio) != c.intermediate_size:
        raise SourceError(path, f"{which} intermediate_size {c.intermediate_size} is not a ratio of width "
                          f"{c.hidden_size} nclip can express")
    if c.hidden_act not in activations:
        raise SourceError(path, f"{which} activation {c.hidden_act!r} is not one of {', '.join(activations)}")
    if abs(c.layer_norm_eps - layer_norm_eps) > 1e-12:
        raise SourceError(path, f"{which} layer_norm_eps {c.layer_norm_eps} is not {layer_norm_eps:g}, {whose}")
    return {"width": c.hidden_size, "layers": c.num_hidden_layers, "heads": c.num_attention_heads,
            "mlp_ratio": ratio, "hidden_act": c.hidden_act}
