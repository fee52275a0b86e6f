"""OpenCLIP and OpenAI checkpoints as nclip models: their architecture as nclip's config, their
weights renamed into nclip's towers (``model.init``, ``nclip eval --checkpoint``, ``nclip.load``).

open_clip's ``VisionTransformer`` and text transformer are the computation of transformers'
CLIPVisionModel / CLIPTextModel, nclip's ViT and text towers: pre-norm residual blocks, one fused
QKV projection (split here into q, k, v), a class token pooled after the final norm, the text pooled
at the end-of-text token (the largest id, ``pool_type: argmax``, or the first ``<end_of_text>``,
``eos``) after a causal transformer. The image and text projections become the CLIP head. The
modified ResNets (RN50, RN101, RN50x4, any widths and depths) are ``model.vision.kind: clip_resnet``
layer for layer, their attention pool's output the CLIP embedding (the CLIP head is then the
identity). Text is tokenized by CLIP's BPE (:mod:`nclip.data.clip_bpe`), images preprocessed at the
checkpoint's size with its mean and std.

What nclip cannot compute the same way is refused in one line naming the setting: timm or
transformers towers, layer scale, attentional pooling, other norms or activations, ...
"""

from __future__ import annotations

import torch

from nclip.config.model import clip_resnet_grid
from nclip.data import clip_bpe
from nclip.errors import NclipError, SourceError
from nclip.models import openclip_files
from nclip.models.openai_layout import openai_config
from nclip.models.openclip_files import (
    OPEN_CLIP,
    OPENAI,
    OPENAI_MEAN,
    OPENAI_STD,
    OpenClipSource,
    Weights,
    vocabulary,
)

TOP_KEYS = {"embed_dim", "vision_cfg", "text_cfg", "quick_gelu", "custom_text", "init_logit_scale",
            "init_logit_bias", "nonscalar_logit_scale", "cast_dtype"}
# settings nclip's towers compute only at these values (open_clip's defaults)
VISION_FIXED = {"ls_init_value": None, "attentional_pool": False, "no_ln_pre": False, "pos_embed_type": "learnable",
                "pool_type": "tok", "act_kwargs": None, "norm_kwargs": None, "block_type": None, "qk_norm": False,
                "scaled_cosine_attn": False, "scale_heads": False, "scale_attn_inner": False, "scale_attn": False,
                "scale_fc": False, "timm_model_name": None}
TEXT_FIXED = {"hf_model_name": None, "hf_tokenizer_name": None, "tokenizer_mode": None, "ls_init_value": None,
              "embed_cls": False, "no_causal_mask": False, "proj_bias": False, "proj_type": "linear",
              "act_kwargs": None, "norm_kwargs": None, "block_type": None, "qk_norm": False,
              "scaled_cosine_attn": False, "scale_heads": False, "scale_attn_inner": False, "scale_attn": False,
              "scale_fc": False}
POOLING = {"argmax": "argmax", "eos": "token"}  # open_clip's text pool_type → model.text.eos_pooling
RESIZE = ("shortest", "squash")  # data.eval_resize (open_clip's "longest" pads: not reproduced)
INTERPOLATION = ("bicubic", "bilinear")  # data.eval_interpolation


def model_config(src: OpenClipSource, weights: Weights | None = None) -> dict:
    """The checkpoint's open_clip model config: its own or ``--arch``'s, else read from its tensors
    as OpenAI's ``build_model`` reads them (``weights``: those of a file, None for a hub directory).

    A file that says it holds OpenAI's weights never gets GELU: an ``--arch`` without QuickGELU is
    refused, naming its ``-quickgelu`` twin. A file that says it is open_clip's needs ``--arch``: open_clip
    trains GELU and QuickGELU models alike, and its weights do not say which."""
    if src.model_cfg is None:
        if weights.origin == OPEN_CLIP:
            raise SourceError(src.path, f"is {weights.evidence}, whose architecture its tensors do not say: name "
                              "the open_clip config it was trained with, --arch NAME (e.g. ViT-B-32)")
        return openai_config(weights.state, src.path)
    openai = weights is not None and weights.origin == OPENAI
    if src.arch is not None and openai and not src.model_cfg.get("quick_gelu"):
        twin = f"--arch {src.arch}-quickgelu, or " if openclip_files.has_builtin(f"{src.arch}-quickgelu") else ""
        raise SourceError(src.path, f"holds OpenAI's weights ({weights.evidence}), which use QuickGELU, but --arch "
                          f"{src.arch} builds GELU: give {twin}no --arch (the architecture is then read from "
                          "its tensors)")
    return src.model_cfg


def architecture(src: OpenClipSource, cfg: dict) -> tuple[dict, dict, dict, int]:
    """(model.vision, model.text, data, embed_dim) of nclip's config for the open_clip config ``cfg``."""
    where = src.path
    unknown = sorted(set(cfg) - TOP_KEYS)
    if unknown:
        raise SourceError(where, f"model_cfg.{unknown[0]} is not a setting nclip can reproduce")
    act = "quick_gelu" if cfg.get("quick_gelu") else "gelu"
    embed_dim = int(cfg["embed_dim"])
    vc, tc = dict(cfg.get("vision_cfg") or {}), dict(cfg.get("text_cfg") or {})
    image_size = vc.get("image_size", 224)
    if isinstance(image_size, (list, tuple)):
        if len(set(image_size)) != 1:
            raise SourceError(where, f"vision_cfg.image_size {list(image_size)} is not square (nclip's images are)")
        image_size = image_size[0]
    vision = _vision(vc, act, embed_dim, int(image_size), where)
    vision.update(_pixels(src.preprocess, where))
    text = _text(tc, act, where)
    text["tokenizer"] = str(vocabulary(src))
    data = {"image_size": int(image_size), "text_length": int(tc.get("context_length", 77)),
            "eval_resize": src.preprocess["resize_mode"], "eval_interpolation": src.preprocess["interpolation"],
            "eval_convention": "torchvision"}
    return vision, text, data, embed_dim


def _fixed(section: dict, fixed: dict, name: str, where) -> None:
    for key, value in fixed.items():
        if section.get(key, value) != value and not (key == "block_type" and section[key] == "default"):
            raise SourceError(where, f"{name}.{key} = {section[key]!r} is not something nclip's towers compute "
                                     f"(only {value!r})")


def _vision(vc: dict, act: str, embed_dim: int, image_size: int, where) -> dict:
    _fixed(vc, VISION_FIXED, "vision_cfg", where)
    width, layers, head_width = int(vc.get("width", 768)), vc.get("layers", 12), int(vc.get("head_width", 64))
    if isinstance(layers, (list, tuple)):  # open_clip's ModifiedResNet
        if len(layers) != 4:
            raise SourceError(where, f"vision_cfg.layers {list(layers)}: a modified ResNet has 4 stages")
        if clip_resnet_grid(image_size, 4) != image_size // 32:
            raise SourceError(where, f"vision_cfg.image_size {image_size} is not a multiple of 32 (the modified "
                                     "ResNet's attention pool sizes differ)")
        return {"kind": "clip_resnet", "embedding_size": width, "depths": [int(d) for d in layers],
                "hidden_sizes": [width * 4 * 2**i for i in range(4)], "heads": width * 32 // head_width,
                "pool_dim": embed_dim}
    if width % head_width:
        raise SourceError(where, f"vision_cfg.width {width} is not a multiple of head_width {head_width}")
    patch = int(vc.get("patch_size", 16))
    if image_size % patch:
        raise SourceError(where, f"vision_cfg.image_size {image_size} is not a multiple of patch_size {patch}")
    return {"kind": "vit", "patch_size": patch, "width": width, "layers": int(layers), "heads": width // head_width,
            "mlp_ratio": _ratio(vc, width, "vision_cfg", where), "hidden_act": act}


def _ratio(section: dict, width: int, name: str, where) -> float:
    ratio = float(section.get("mlp_ratio", 4.0))
    if int(width * ratio) <= 0:
        raise SourceError(where, f"{name}.mlp_ratio {ratio} leaves no MLP")
    return ratio


def _text(tc: dict, act: str, where) -> dict:
    _fixed(tc, TEXT_FIXED, "text_cfg", where)
    clean = (tc.get("tokenizer_kwargs") or {}).get("clean", "lower")
    if clean != "lower" or set(tc.get("tokenizer_kwargs") or {}) - {"clean"}:
        raise SourceError(where, f"text_cfg.tokenizer_kwargs {tc['tokenizer_kwargs']} is not CLIP's default "
                                 "tokenizer (clean: lower), the one nclip reproduces")
    pool = tc.get("pool_type", "argmax")
    if pool not in POOLING:
        raise SourceError(where, f"text_cfg.pool_type {pool!r} is not one nclip's text tower pools "
                                 f"({', '.join(POOLING)})")
    if pool == "eos" and tc.get("eos_id", 2) != clip_bpe.MERGES + 512 + 1:
        raise SourceError(where, f"text_cfg.eos_id {tc.get('eos_id', 2)} is not the id of CLIP's {clip_bpe.EOT}")
    width, heads = int(tc.get("width", 512)), int(tc.get("heads", 8))
    if width % heads:
        raise SourceError(where, f"text_cfg.width {width} is not divisible by heads {heads}")
    return {"kind": "transformer", "width": width, "layers": int(tc.get("layers", 12)), "heads": heads,
            "mlp_ratio": _ratio(tc, width, "text_cfg", where), "hidden_act": act,
            "vocab_size": int(tc.get("vocab_size", 49408)), "eos_pooling": POOLING[pool]}


def _pixels(pre: dict, where) -> dict:
    """pixel_mean/std where the checkpoint's are not CLIP's (the towers re-normalise); the resize and
    interpolation must be ones nclip's evaluation pipeline has."""
    if pre.get("resize_mode") not in RESIZE:
        raise NclipError(f"{where}: preprocess_cfg.resize_mode {pre.get('resize_mode')!r}: nclip resizes with "
                         f"{' or '.join(RESIZE)} only")
    if pre.get("interpolation") not in INTERPOLATION:
        raise NclipError(f"{where}: preprocess_cfg.interpolation {pre.get('interpolation')!r}: nclip resizes "
                         f"with {' or '.join(INTERPOLATION)} interpolation only")
    mean, std = tuple(float(x) for x in pre["mean"]), tuple(float(x) for x in pre["std"])
    if len(mean) != 3 or len(std) != 3:
        raise NclipError(f"{where}: preprocess_cfg mean/std must have 3 channels")
    same = all(abs(a - b) < 1e-6 for a, b in zip(mean + std, OPENAI_MEAN + OPENAI_STD))
    return {} if same else {"pixel_mean": list(mean), "pixel_std": list(std)}


# ---------------------------------------------------------------------------------------------
# the weights
# ---------------------------------------------------------------------------------------------

# open_clip's names → a transformers CLIPModel's (a name without suffix also renames its .weight and .bias);
# nclip.models.export_openclip maps them back
VIT_RENAMES = {"visual.class_embedding": "vision_model.embeddings.class_embedding",
               "visual.conv1": "vision_model.embeddings.patch_embedding",
               "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
               "visual.ln_pre": "vision_model.pre_layrnorm", "visual.ln_post": "vision_model.post_layernorm"}
TEXT_RENAMES = {"token_embedding": "text_model.embeddings.token_embedding",
                "positional_embedding": "text_model.embeddings.position_embedding.weight",
                "ln_final": "text_model.final_layer_norm"}
TRANSPOSED = {"visual.proj": "visual_projection.weight", "text_projection": "text_projection.weight"}  # [in, out]
BLOCKS = {"visual": ("visual.transformer", "vision_model.encoder"), "text": ("transformer", "text_model.encoder")}
HF_LAYER = {"ln_1": "layer_norm1", "ln_2": "layer_norm2", "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2",
            "attn.out_proj": "self_attn.out_proj"}


def _blocks(state: dict, src: str, dst: str, out: dict, names: dict) -> None:
    """open_clip's residual blocks ``src``.resblocks.i → transformers' ``dst``.layers.i."""
    for key, value in state.items():
        if not key.startswith(src + ".resblocks."):
            continue
        i, rest = key[len(src) + 11:].split(".", 1)
        base = f"{dst}.layers.{i}."
        if rest.startswith("attn.in_proj_"):  # fused [q; k; v] → three projections
            kind = rest.rsplit("_", 1)[1]  # weight or bias
            for name, part in zip("qkv", value.chunk(3, dim=0)):
                out[f"{base}self_attn.{name}_proj.{kind}"] = part
                names[f"{base}self_attn.{name}_proj.{kind}"] = f"{key} (its {name} third)"
            continue
        for theirs, ours in HF_LAYER.items():
            if rest.startswith(theirs + "."):
                out[base + ours + rest[len(theirs):]] = value
                names[base + ours + rest[len(theirs):]] = key


def _renamed(state: dict, renames: dict[str, str], out: dict, names: dict) -> None:
    for theirs, ours in renames.items():
        for suffix in ("", ".weight", ".bias"):
            if theirs + suffix in state:
                out[ours + suffix] = state[theirs + suffix]
                names[ours + suffix] = theirs + suffix


def transformers_names(state: dict[str, torch.Tensor], embed_dim: int,
                       names: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """open_clip weights → a transformers CLIPModel's names for the ViT and the text tower, the CLIP
    head and logit scale; the modified ResNet under nclip's own ``vision.*`` names. ``names`` (if
    given) gets each new name's tensor as the file names it, for messages."""
    out: dict[str, torch.Tensor] = {}
    names = {} if names is None else names
    if "visual.attnpool.positional_embedding" in state:
        for theirs, ours in _resnet_keys(state):
            out[ours], names[ours] = state[theirs], theirs
        out["visual_projection.weight"] = torch.eye(embed_dim)  # the attention pool projects already
    else:
        _renamed(state, VIT_RENAMES, out, names)
        _blocks(state, *BLOCKS["visual"], out, names)
    for theirs, ours in TRANSPOSED.items():
        if theirs in state:
            out[ours], names[ours] = state[theirs].t(), theirs
    _renamed(state, TEXT_RENAMES, out, names)
    if "logit_scale" in state:
        out["logit_scale"], names["logit_scale"] = state["logit_scale"].reshape(()), "logit_scale"
    _blocks(state, *BLOCKS["text"], out, names)
    return {k: v.contiguous() for k, v in out.items()}


STEM = {"conv1": 0, "bn1": 1, "conv2": 3, "bn2": 4, "conv3": 6, "bn3": 7}  # → ClipResNetTower.stem.N
POOL = {"positional_embedding": "position", "q_proj": "query", "k_proj": "key", "v_proj": "value", "c_proj": "proj"}


def branch_slots(pooled: bool) -> dict[str, int]:
    """open_clip Bottleneck's layers → their slots in :class:`~nclip.models.clip_resnet.Bottleneck`'s
    branch (a block that halves the map has its average pool before the last convolution)."""
    return {"conv1": 0, "bn1": 1, "conv2": 3, "bn2": 4, "conv3": 6 + pooled, "bn3": 7 + pooled}


def resnet_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """open_clip's ModifiedResNet (``visual.*``) → :class:`~nclip.models.clip_resnet.ClipResNetTower`
    (``vision.*``): the same layers in Sequential slots; a block that halves the map has its 2×2
    average pool in the slot before its last convolution and first in its shortcut."""
    return {ours: state[theirs] for theirs, ours in _resnet_keys(state)}


def _resnet_keys(state: dict) -> list[tuple[str, str]]:
    """(open_clip's name, nclip's) of each modified-ResNet tensor of ``state``."""
    out = []
    for key in state:
        parts = key.split(".")
        if parts[0] != "visual":
            continue
        if parts[1] in STEM:
            out.append((key, f"vision.stem.{STEM[parts[1]]}.{'.'.join(parts[2:])}"))
        elif parts[1] == "attnpool":
            out.append((key, f"vision.pool.{POOL[parts[2]]}{'.' + '.'.join(parts[3:]) if len(parts) > 3 else ''}"))
        elif parts[1].startswith("layer") and parts[1][5:].isdigit():
            stage, block = int(parts[1][5:]) - 1, int(parts[2])
            pooled = stage > 0 and block == 0
            slots = branch_slots(pooled)
            base = f"vision.stages.{stage}.{block}."
            if parts[3] in slots:
                out.append((key, f"{base}branch.{slots[parts[3]]}.{'.'.join(parts[4:])}"))
            elif parts[3] == "downsample":
                out.append((key, f"{base}shortcut.{int(parts[4]) + pooled}.{'.'.join(parts[5:])}"))
    return out
