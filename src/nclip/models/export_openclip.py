"""Export to open_clip's hub layout: ``open_clip_config.json`` and ``open_clip_model.safetensors``.

The inverse of the reader (:mod:`nclip.models.openclip_import`, whose key tables it maps back): the
ViT and CLIP-style text towers are transformers' CLIPVisionModel / CLIPTextModel, the computation of
open_clip's ``VisionTransformer`` and text transformer, so their tensors are renamed (q, k and v
fused into one ``in_proj``) and the CLIP head becomes open_clip's ``visual.proj`` and
``text_projection``. The modified ResNet (``clip_resnet``) is open_clip's ``ModifiedResNet`` layer for
layer; its attention pool projects to the embedding itself, so the linear CLIP head is folded into
the pool's output projection (W' = H·W, b' = H·b). Text is CLIP's BPE, pooled at the end-of-text
token (``argmax`` or ``eos``), and the preprocessing (size, resize, interpolation, the tower's mean
and std) goes into ``preprocess_cfg``. The BPE vocabulary is copied beside the weights, where
nclip's reader looks first; open_clip tokenizes with the copy it ships (the same file).

What open_clip cannot express is refused in one line naming why: another image tower, the
pretrained (MiniLM) text tower or a tokenizer that is not CLIP's BPE, a model without a CLIP head
or whose CLIP head is an MLP (shared nCLIP layers). A model with other heads besides (xCLIP's nCLIP
head) exports its CLIP head alone: open_clip scores by CLIP's cosine.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from nclip.config.model import clip_resnet_grid
from nclip.data import clip_bpe
from nclip.errors import NclipError
from nclip.models import openclip_import as reader
from nclip.models.export_base import atomic_export, check_clip_score, model_dir
from nclip.models.export_transformers import clip_model_names
from nclip.models.io import load_model
from nclip.models.openclip_files import HUB_CONFIG, HUB_WEIGHTS

WEIGHTS = HUB_WEIGHTS[0]  # open_clip_model.safetensors


def check(model, cfg) -> None:
    """Refuse, in one line naming why, a model open_clip cannot express."""
    m = cfg.model
    why = None
    if model.vision.kind not in ("vit", "clip_resnet"):
        why = f"its image tower is {model.vision.kind!r} (open_clip's are the ViT and the modified ResNet)"
    elif model.cfg_text_kind != "transformer":
        why = (f"its text tower is {model.cfg_text_kind!r} (a pretrained encoder such as MiniLM; open_clip's is "
               "the CLIP-style causal transformer)")
    elif m.text.tokenizer is None or clip_bpe.bpe_file(Path(m.text.tokenizer).expanduser()) is None:
        why = ("its tokenizer is not CLIP's BPE (model.text.tokenizer: "
               f"{m.text.tokenizer or 'the bundled WordPiece'}), the only one open_clip's CLIP models tokenize with")
    elif "clip" not in model.heads:
        why = f"it has no CLIP head (heads {sorted(model.heads)}): open_clip scores with CLIP's projections"
    elif "shared" in model.heads:
        why = (f"its CLIP head is an MLP ({model.heads['shared'].count} hidden layer(s) shared with the nCLIP head, "
               "model.nclip_shared_layers); open_clip's projections are linear")
    elif m.vision.kind == "vit" and m.vision.hidden_act != m.text.hidden_act:
        why = (f"its towers use different activations ({m.vision.hidden_act} and {m.text.hidden_act}); open_clip "
               "has one quick_gelu switch for both")
    elif m.vision.kind == "clip_resnet":
        why = _resnet_problem(m.vision, cfg.data.image_size)
    if why:
        raise NclipError(f"export --open-clip: open_clip cannot express this model: {why}")


def _resnet_problem(v, image_size: int) -> str | None:
    width = v.embedding_size
    if len(v.depths) != 4 or list(v.hidden_sizes) != [width * 4 * 2**i for i in range(4)]:
        return (f"model.vision depths {list(v.depths)} / hidden_sizes {list(v.hidden_sizes)}: open_clip's modified "
                f"ResNet has 4 stages of {[width * 4 * 2**i for i in range(4)]} channels for embedding_size {width}")
    if v.hidden_sizes[-1] % v.heads:
        return f"model.vision.heads {v.heads} does not divide the pool's width {v.hidden_sizes[-1]}"
    if clip_resnet_grid(image_size, 4) != image_size // 32:
        return f"data.image_size {image_size} is not a multiple of 32 (open_clip's attention pool sizes differ)"
    return None


def vit_cfg(cfg) -> dict:
    """open_clip's ``vision_cfg`` of the run ``cfg``'s ViT image tower."""
    v = cfg.model.vision
    return {"image_size": cfg.data.image_size, "layers": v.layers, "width": v.width,
            "head_width": v.width // v.heads, "patch_size": v.patch_size, "mlp_ratio": v.mlp_ratio}


def text_cfg(cfg, vocab_size: int) -> dict:
    """open_clip's ``text_cfg`` of the run ``cfg``'s text transformer with a vocabulary of ``vocab_size``."""
    t = cfg.model.text
    return {"context_length": cfg.data.text_length, "vocab_size": vocab_size, "width": t.width, "heads": t.heads,
            "layers": t.layers, "mlp_ratio": t.mlp_ratio}


def model_cfg(model, cfg) -> dict:
    """open_clip's model config (``CLIP(**model_cfg)``) of ``model``: what the reader turns back into
    ``cfg``'s architecture (:func:`nclip.models.openclip_import.architecture`)."""
    m = cfg.model
    if m.vision.kind == "vit":
        vision = vit_cfg(cfg)
    else:
        vision = {"image_size": cfg.data.image_size, "layers": list(m.vision.depths), "width": m.vision.embedding_size,
                  "head_width": m.vision.hidden_sizes[-1] // m.vision.heads}
    text = text_cfg(cfg, model.text.model.config.vocab_size)
    if m.text.eos_pooling == "token":  # the first end-of-text token (open_clip's default: the largest id)
        text.update(pool_type="eos", eos_id=model.tokenizer.eos_id)
    out = {"embed_dim": model.heads["clip"].image.out_features, "vision_cfg": vision, "text_cfg": text}
    if m.text.hidden_act == "quick_gelu":
        out["quick_gelu"] = True
    return out


def preprocess_cfg(cfg) -> dict:
    """open_clip's ``PreprocessCfg`` of the run's evaluation transform: the pixels the image tower
    was trained on (its own mean/std where it re-normalises, else CLIP's)."""
    v = cfg.model.vision
    mean = list(v.pixel_mean) if v.pixel_mean is not None else list(reader.OPENAI_MEAN)
    std = list(v.pixel_std) if v.pixel_std is not None else list(reader.OPENAI_STD)
    return {"size": cfg.data.image_size, "mode": "RGB", "mean": mean, "std": std,
            "interpolation": cfg.data.eval_interpolation, "resize_mode": cfg.data.eval_resize}


def openclip_state(model) -> dict[str, torch.Tensor]:
    """``model``'s weights under open_clip CLIP's names (float32, contiguous)."""
    ours = clip_model_names("text_model.", model.text.model)
    out = _unrenamed(ours, reader.TEXT_RENAMES)
    out.update(_resblocks(ours, *reader.BLOCKS["text"]))
    out["text_projection"] = model.heads["clip"].text.weight.t()
    head = model.heads["clip"].image.weight  # [D, d]
    if model.vision.kind == "vit":
        ours = clip_model_names("vision_model.", model.vision.model)
        out.update(_unrenamed(ours, reader.VIT_RENAMES))
        out.update(_resblocks(ours, *reader.BLOCKS["visual"]))
        out["visual.proj"] = head.t()
    else:
        out.update(resnet_state(model.vision.state_dict()))
        # the attention pool's output projection followed by the CLIP head is one linear map
        out["visual.attnpool.c_proj.weight"] = head @ out["visual.attnpool.c_proj.weight"]
        out["visual.attnpool.c_proj.bias"] = head @ out["visual.attnpool.c_proj.bias"]
    out["logit_scale"] = model.logit_scale.detach().clamp(max=model.LOGIT_SCALE_MAX).reshape(())
    return {k: v.detach().float().contiguous() for k, v in out.items()}


def _unrenamed(ours: dict, renames: dict[str, str]) -> dict:
    out = {}
    for theirs, name in renames.items():
        for suffix in ("", ".weight", ".bias"):
            if name + suffix in ours:
                out[theirs + suffix] = ours[name + suffix]
    return out


def _resblocks(ours: dict, theirs: str, name: str) -> dict:
    """transformers' ``name``.layers.i → open_clip's ``theirs``.resblocks.i, q, k and v fused."""
    back = {hf: oc for oc, hf in reader.HF_LAYER.items()}
    out, fused = {}, {}
    for key, value in ours.items():
        if not key.startswith(name + ".layers."):
            continue
        i, rest = key[len(name) + 8:].split(".", 1)
        base = f"{theirs}.resblocks.{i}."
        part, _, kind = rest.rpartition(".")
        if part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            fused.setdefault(f"{base}attn.in_proj_{kind}", {})[part[10]] = value
            continue
        for hf, oc in back.items():
            if rest.startswith(hf + "."):
                out[base + oc + rest[len(hf):]] = value
    for key, parts in fused.items():  # [q; k; v]
        out[key] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    return out


def resnet_state(tower: dict) -> dict[str, torch.Tensor]:
    """:class:`~nclip.models.clip_resnet.ClipResNetTower`'s tensors → open_clip ModifiedResNet's
    (``visual.*``): :func:`nclip.models.openclip_import.resnet_names` backwards."""
    stem = {slot: name for name, slot in reader.STEM.items()}
    pool = {ours: theirs for theirs, ours in reader.POOL.items()}
    out = {}
    for key, value in tower.items():
        parts = key.split(".")
        if parts[0] == "stem":
            out[".".join(["visual", stem[int(parts[1])], *parts[2:]])] = value
        elif parts[0] == "pool":
            out[".".join(["visual.attnpool", pool[parts[1]], *parts[2:]])] = value
        elif parts[0] == "stages":
            stage, block, where, slot = int(parts[1]), int(parts[2]), parts[3], int(parts[4])
            pooled = stage > 0 and block == 0
            base = f"visual.layer{stage + 1}.{block}."
            if where == "branch":
                layer = {s: n for n, s in reader.branch_slots(pooled).items()}[slot]
                out[base + ".".join([layer, *parts[5:]])] = value
            else:  # the shortcut: [2×2 average pool,] 1×1 convolution, BatchNorm
                out[base + ".".join(["downsample", str(slot - pooled), *parts[5:]])] = value
    return out


def export_openclip(checkpoint: Path, out: Path) -> str:
    """Write the model of ``checkpoint`` (a run or model directory) to ``out`` in open_clip's hub
    layout, atomically (:func:`nclip.models.export_base.atomic_export`)."""
    model, cfg = load_model(model_dir(checkpoint))
    check(model, cfg)
    check_clip_score(cfg, "--open-clip")
    with torch.no_grad():
        state = openclip_state(model)
    config = {"model_cfg": model_cfg(model, cfg), "preprocess_cfg": preprocess_cfg(cfg)}
    with atomic_export(out, "open_clip") as tmp:
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / HUB_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        shutil.copyfile(clip_bpe.bpe_file(Path(cfg.model.text.tokenizer).expanduser()), tmp / clip_bpe.BPE_FILE)
    return f"wrote an open_clip model ({HUB_CONFIG}, {WEIGHTS}, CLIP's BPE vocabulary) to {out}"
