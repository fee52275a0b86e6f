"""The architecture of a CLIP state dict in OpenAI's layout, read from its tensors as OpenAI's
``clip.model.build_model(state_dict)`` reads it; shared by OpenAI's TorchScript archives and plain
state-dict files (:mod:`nclip.models.openclip_files`).

OpenAI's layout is also open_clip's ``CLIP`` naming: ``visual.conv1.weight``, ``visual.proj`` and
``visual.transformer.resblocks.N.*`` for a ViT (``visual.layerN.*`` and ``visual.attnpool.*`` for the
modified ResNet), ``token_embedding.weight``, ``positional_embedding``, ``transformer.resblocks.N.*``,
``ln_final``, ``text_projection``, ``logit_scale``. ``build_model`` reads every size from the tensor
shapes -- widths, layers, patch size, grid, ResNet stage depths, embedding width, context length,
vocabulary -- and fixes the rest: ``width // 64`` heads in each transformer, ``width * 32 // 64`` in the
ResNet's attention pool, MLPs four times as wide, and QuickGELU, the activation of every CLIP OpenAI
trained. The result is that model's open_clip config (``quick_gelu: true``), which
:mod:`nclip.models.openclip_import` turns into nclip's.
"""

from __future__ import annotations

import torch

from nclip.errors import SourceError

HEAD_WIDTH = 64  # build_model's: heads = width // 64


def openai_config(state: dict[str, torch.Tensor], path) -> dict:
    """The open_clip model config of the CLIP whose weights are ``state`` (OpenAI's names), as
    OpenAI's ``build_model`` infers it; a one-line error naming ``path`` for what it cannot build."""
    try:
        vision = _vit(state, path) if "visual.proj" in state else _resnet(state, path)
        width = state["ln_final.weight"].shape[0]
        text = {"context_length": state["positional_embedding"].shape[0],
                "vocab_size": state["token_embedding.weight"].shape[0], "width": width,
                "heads": _heads(width, "text tower", path),
                "layers": len({k.split(".")[2] for k in state if k.startswith("transformer.resblocks.")})}
        embed_dim = state["text_projection"].shape[1]
    except (KeyError, IndexError):
        raise SourceError(path, "is not a CLIP state dict in OpenAI's layout, so its architecture cannot be read "
                          "from its tensors: name its open_clip config with --arch NAME") from None
    return {"embed_dim": int(embed_dim), "quick_gelu": True, "vision_cfg": vision, "text_cfg": text}


def _vit(state: dict, path) -> dict:
    width, _, _, patch = state["visual.conv1.weight"].shape
    positions = state["visual.positional_embedding"].shape[0]
    grid = round((positions - 1) ** 0.5)
    if grid * grid + 1 != positions:
        raise SourceError(path, f"its image tower has {positions} positions, not a square grid of patches and a "
                          "class token")
    heads = _heads(width, "image tower", path)
    return {"layers": len([k for k in state if k.startswith("visual.") and k.endswith(".attn.in_proj_weight")]),
            "width": width, "patch_size": patch, "image_size": patch * grid, "head_width": width // heads}


def _resnet(state: dict, path) -> dict:
    depths = [len({k.split(".")[2] for k in state if k.startswith(f"visual.layer{b}.")}) for b in (1, 2, 3, 4)]
    width = state["visual.layer1.0.conv1.weight"].shape[0]
    positions = state["visual.attnpool.positional_embedding"].shape[0]
    side = round((positions - 1) ** 0.5)
    if side * side + 1 != positions:
        raise SourceError(path, f"its attention pool has {positions} positions, not a square grid and a mean token")
    pool = width * 32  # the last stage's channels, the attention pool's width
    heads = _heads(pool, "attention pool", path)
    return {"layers": depths, "width": width, "image_size": side * 32, "head_width": pool // heads}


def _heads(width: int, what: str, path) -> int:
    """build_model's number of heads, ``width // 64``; an error where its attention cannot split ``width`` so."""
    heads = width // HEAD_WIDTH
    if heads == 0 or width % heads:
        raise SourceError(path, f"its {what} is {width} wide, which OpenAI's CLIP cannot split into "
                          f"{width} // {HEAD_WIDTH} = {heads} heads")
    return heads
