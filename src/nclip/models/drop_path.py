"""Drop path (stochastic depth; Huang et al. 2016) on a built image tower: each residual branch is
dropped per sample while the tower trains, with a rate rising linearly from 0 at the first block to
``rate`` at the last (timm's schedule, which GroupViT and BEiT use), the kept ones scaled by
1/(1 − rate). The branches are the ViT's attention and MLP per block, the ResNets' bottleneck
branch (clip_resnet: each block's ``branch``) and GroupViT's attention and MLP of every stage's
layers (not its grouping blocks, to which GroupViT gives none). Forward hooks on the branch modules
do the dropping, so the towers stay the stock modules and their state dicts do not change. The
convnet tower has no residual connections, so it has no drop path.

Pre-training sets it with ``model.vision.drop_path_rate`` (GroupViT's 0.1; groupvit towers) and
fine-tuning with its ``--drop-path`` (:mod:`nclip.finetune.layers`); a second call replaces the
first's hooks, so a fine-tuning rate is never stacked on the pre-training one.
"""

from __future__ import annotations

import torch
from torch import nn


def _drop(x: torch.Tensor, rate: float) -> torch.Tensor:
    """x [B, ...] with each sample's branch zeroed with probability ``rate``, the rest scaled."""
    keep = 1.0 - rate
    mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
    return x * mask / keep


def _hook(rate: float):
    def hook(module, inputs, output):
        if not module.training or rate <= 0:
            return None
        if isinstance(output, tuple):  # the attention's (output, weights)
            return (_drop(output[0], rate), *output[1:])
        return _drop(output, rate)
    return hook


def _branches(tower: nn.Module) -> tuple[list[list[nn.Module]], str] | None:
    """The residual branches of ``tower``, block by block, and how they are named; None: it has none."""
    if tower.kind == "vit":
        blocks = list(getattr(tower.model, "vision_model", tower.model).encoder.layers)  # transformers versions differ
        return [[b.self_attn, b.mlp] for b in blocks], "per transformer block, attention and MLP branches"
    if tower.kind == "resnet":
        return [[block.layer] for stage in tower.model.encoder.stages for block in stage.layers], "per bottleneck block"
    if tower.kind == "clip_resnet":
        return [[block.branch] for stage in tower.stages for block in stage], "per bottleneck block"
    if tower.kind == "groupvit":
        return ([[layer.self_attn, layer.mlp] for stage in tower.model.vision_model.encoder.stages
                 for layer in stage.layers], "per transformer layer of every stage, attention and MLP branches")
    return None


def add_drop_path(tower: nn.Module, rate: float) -> str:
    """Drop the residual branches of ``tower`` (a VisionTower, ResNetTower, ClipResNetTower, GroupViTTower
    or ConvNetTower) with a linear schedule up to ``rate`` while it trains, in place of any earlier
    call's; returns how (for results.json and the run's start-up block)."""
    for handle in getattr(tower, "_drop_path_hooks", ()):
        handle.remove()
    tower._drop_path_hooks = []
    if rate <= 0:
        return "none (drop_path 0)"
    found = _branches(tower)
    if found is None:
        return "none (convnet has no residual blocks)"
    branches, how = found
    for i, modules in enumerate(branches):
        r = rate * i / max(len(branches) - 1, 1)
        tower._drop_path_hooks += [m.register_forward_hook(_hook(r)) for m in modules]
    return f"{rate} (linear 0 to {rate} over {len(branches)} blocks, {how})"
