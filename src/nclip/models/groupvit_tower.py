"""GroupViT's image tower (Xu et al. 2022, "GroupViT: Semantic Segmentation Emerges from Text
Supervision"), built from scratch on transformers' ``GroupViTVisionModel`` (``model.vision.kind:
groupvit``).

The patch tokens go through stages of transformer layers; each grouping stage appends learned group
tokens, and its grouping block assigns every input token to one group (Gumbel-softmax with a hard,
straight-through assignment while training; the arg-max one at eval) and merges them into the groups.
The last stage's group tokens, after the final LayerNorm, are the image's segments; their mean is
GroupViT's pooled output, this tower's feature. ``model.vision.drop_path_rate`` adds GroupViT's drop
path to the stages' layers (transformers' port has none; :mod:`nclip.models.drop_path`).

:meth:`GroupViTTower.groups` returns the segments and where they lie, for zero-shot segmentation
(:mod:`nclip.eval.segmentation`): each stage's soft assignment (transformers returns them with
``output_attentions``) multiplied from the patches to the last stage's groups, as the GroupViT paper
(Sec. 3.3) and transformers' ``get_grouping_from_attentions`` do.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GroupViTVisionConfig, GroupViTVisionModel

from nclip.config import VisionConfig
from nclip.models import recompute
from nclip.models.drop_path import add_drop_path


def groupvit_config(cfg: VisionConfig, image_size: int) -> GroupViTVisionConfig:
    return GroupViTVisionConfig(
        hidden_size=cfg.width,
        intermediate_size=int(cfg.width * cfg.mlp_ratio),
        num_hidden_layers=sum(cfg.depths),
        depths=list(cfg.depths),
        num_group_tokens=list(cfg.group_tokens),
        num_output_groups=list(cfg.output_groups),
        num_attention_heads=cfg.heads,
        image_size=image_size,
        patch_size=cfg.patch_size,
        hidden_act=cfg.hidden_act,
    )


def patch_assignment(stage_assignments: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> torch.Tensor:
    """Each grouping stage's assignment [B, G_s, N_s] (groups × the stage's input tokens; N_1 the
    patches, N_s = G_{s-1}) multiplied to the patches' assignment to the last groups [B, N_1, G_last]:
    A = A_1ᵀ A_2ᵀ … (GroupViT Sec. 3.3). Rows sum to 1 when each stage's columns do."""
    out = stage_assignments[0].transpose(1, 2)
    for a in stage_assignments[1:]:
        out = out @ a.transpose(1, 2)
    return out


class GroupViTTower(nn.Module):
    kind = "groupvit"
    feature = "the mean of the last stage's group tokens (GroupViT's pooled output)"
    saliency = None  # no [CLS] or attention pool: its grouping is read by the segmentation task instead

    def __init__(self, config: GroupViTVisionConfig, drop_path_rate: float = 0.0):
        super().__init__()
        self.model = GroupViTVisionModel(config)
        self.width = config.hidden_size
        # transformers' port has no drop path: hooks on its layers' branches add GroupViT's
        self.drop_path = add_drop_path(self, drop_path_rate)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, 3, S, S] normalised → pooled feature [B, width]."""
        return self.model(pixel_values=pixels).pooler_output

    @torch.no_grad()
    def groups(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pixels [B, 3, S, S] → (the last stage's final-norm group tokens [B, G, width], the patches'
        soft assignment to them [B, G, h, w] on the patch grid, summing to 1 over G)."""
        out = self.model(pixel_values=pixels, output_attentions=True)
        assign = patch_assignment(out.attentions)  # [B, h*w, G]
        side = int(round(assign.shape[1] ** 0.5))
        return out.last_hidden_state, assign.transpose(1, 2).reshape(assign.shape[0], -1, side, side)

    def enable_grad_checkpointing(self) -> None:
        recompute.enable_hf(self.model)  # each encoder layer
