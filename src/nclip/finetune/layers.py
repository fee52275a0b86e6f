"""Layer-wise learning-rate decay and drop path for fine-tuning (xCLIP App. C, the BEiT recipe).

Layer-wise decay: every parameter gets a layer id l in 0 … n−1 and the learning rate
lr · decay^(n − 1 − l), so the input end moves least and the classifier at the full rate:

===========  ==================================================================================
tower        layer ids
===========  ==================================================================================
vit          0: patch and position embeddings, [CLS] token, pre-norm; 1 … L: transformer block
             1 … L; L + 1: final norm, CLIP head (and shared head layers), classifier, logit scale
resnet       0: stem (embedder); 1 … S: stage 1 … S (all its bottleneck blocks);
             S + 1: CLIP head, classifier, logit scale
clip_resnet  0: 3-conv stem; 1 … S: stage 1 … S (all its bottleneck blocks); S + 1: attention
             pooling (position embedding, q/k/v, output projection), CLIP head, classifier,
             logit scale
convnet      0: stem conv; 1 … S: stage 1 … S (its convs; a stage's max pool has no weights);
             S + 1: attention pooling (query position embedding, attention, norm), CLIP head,
             classifier, logit scale
groupvit     0: patch and position embeddings; 1 … S: stage 1 … S (its layers, group tokens and
             grouping block); S + 1: final norm, CLIP head, classifier, logit scale
===========  ==================================================================================

The conv towers decay per stage rather than per block: their stages, not their blocks, are the
units of resolution, as in ConvNeXt's and BEiT-style recipes for conv nets.

Weight decay (0.05) is applied to matrices only; biases, norms, the [CLS] token, position
embeddings and the logit scale get none (BEiT's exclusions).

Drop path (stochastic depth, rate r = 0.1 in App. C): :func:`nclip.models.drop_path.add_drop_path`,
each residual branch dropped per sample with a rate rising linearly from 0 at the first block to r
at the last, in place of the pre-training's (``model.vision.drop_path_rate``). The convnet tower has
no residual connections, so it has no drop path: the run records "none (convnet has no residual
blocks)" rather than pretending.
"""

from __future__ import annotations

import re

from torch import nn

_VIT_BLOCK = re.compile(r"\.encoder\.layers\.(\d+)\.")
_RESNET_STAGE = re.compile(r"\.encoder\.stages\.(\d+)\.")
_CLIP_RESNET_STAGE = re.compile(r"^vision\.stages\.(\d+)\.")
_CONV_BODY = re.compile(r"^vision\.body\.(\d+)\.")
_NO_DECAY_NAMES = ("class_embedding", "position_embedding", "vision.position", "vision.pool.position",
                   "logit_scale")


def layer_count(vision_cfg) -> int:
    """n: the number of layer ids of the tower described by ``vision_cfg`` (model.vision)."""
    if vision_cfg.kind == "vit":
        return vision_cfg.layers + 2
    return len(vision_cfg.depths) + 2


def _convnet_stages(vision_cfg) -> list[int]:
    """The stage (layer id) of every module index of ConvNetTower.body (see its constructor)."""
    stage_of = [0, 0, 0]  # the stem: conv, BN, GELU
    for s, depth in enumerate(vision_cfg.depths):
        stage_of += [s + 1] * ((1 if s > 0 else 0) + 3 * depth)
    return stage_of


def layer_id(name: str, vision_cfg) -> int:
    """The layer id of parameter ``name`` of a :class:`~nclip.finetune.network.FinetuneNet`."""
    top = layer_count(vision_cfg) - 1
    if not name.startswith("vision."):
        return top  # heads, classifier, logit scale
    if vision_cfg.kind == "vit":
        m = _VIT_BLOCK.search(name)
        if m:
            return int(m.group(1)) + 1
        return 0 if (".embeddings." in name or ".pre_layrnorm." in name) else top
    if vision_cfg.kind in ("resnet", "groupvit"):  # both transformers models keep their stages in encoder.stages
        m = _RESNET_STAGE.search(name)
        if m:
            return int(m.group(1)) + 1
        return 0 if (".embedder." in name or ".embeddings." in name) else top
    if vision_cfg.kind == "clip_resnet":
        m = _CLIP_RESNET_STAGE.search(name)
        if m:
            return int(m.group(1)) + 1
        return 0 if name.startswith("vision.stem.") else top
    m = _CONV_BODY.search(name)
    return _convnet_stages(vision_cfg)[int(m.group(1))] if m else top


def lr_scale(layer: int, count: int, decay: float) -> float:
    """decay^(n − 1 − l): 1 for the top layer, decay^(n − 1) for the embeddings."""
    return decay ** (count - 1 - layer)


def param_groups(model: nn.Module, vision_cfg, decay: float, weight_decay: float) -> list[dict]:
    """One optimizer group per (layer id, decayed or not), in a fixed order, each with ``layer``,
    ``lr_scale`` (the loop multiplies its scheduled lr by it) and ``weight_decay``."""
    count = layer_count(vision_cfg)
    buckets: dict[tuple[int, bool], list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decayed = p.ndim >= 2 and not any(k in name for k in _NO_DECAY_NAMES)
        buckets.setdefault((layer_id(name, vision_cfg), decayed), []).append(p)
    return [{"params": params, "layer": layer, "lr_scale": lr_scale(layer, count, decay),
             "weight_decay": weight_decay if decayed else 0.0}
            for (layer, decayed), params in sorted(buckets.items())]
