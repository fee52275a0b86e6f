"""SigLIP's towers (Zhai et al. 2023), built from nclip's config as transformers' own SigLIP models.

``model.vision.pooling: map`` -- transformers' ``SiglipVisionModel``: a ViT without class token or
pre-norm (patch embedding + position embeddings, the encoder, a post-norm), whose feature is the
output of its multi-head attention-pooling head (``SiglipMultiheadAttentionPoolingHead``: a learned
probe attends over the patch tokens, then a residual MLP). ``model.text.eos_pooling: last`` --
transformers' ``SiglipTextModel``: bidirectional attention without a padding mask (SigLIP pads to
its fixed length and was trained that way), the final-norm state of the *last position* (the
end-of-text token, or padding after it), through its ``head`` Linear(width, width) with bias.

As with CLIP, nclip's towers *are* transformers' models, so a SigLIP checkpoint's weights load by
renaming (:mod:`nclip.models.siglip_import`). Both use SigLIP's LayerNorm ε, 1e-6.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import SiglipTextConfig, SiglipTextModel, SiglipVisionConfig, SiglipVisionModel

from nclip.config import TextConfig, VisionConfig
from nclip.models import pixel_stats, recompute

LAYER_NORM_EPS = 1e-6  # SigLIP's (transformers' default and every released checkpoint's)


def siglip_vision_config(cfg: VisionConfig, image_size: int) -> SiglipVisionConfig:
    return SiglipVisionConfig(hidden_size=cfg.width, intermediate_size=int(cfg.width * cfg.mlp_ratio),
                              num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, image_size=image_size,
                              patch_size=cfg.patch_size, hidden_act=cfg.hidden_act, layer_norm_eps=LAYER_NORM_EPS,
                              vision_use_head=True, attn_implementation="sdpa")


def siglip_text_config(cfg: TextConfig, vocab_size: int, length: int, pad_id: int, eos_id: int) -> SiglipTextConfig:
    return SiglipTextConfig(vocab_size=vocab_size, hidden_size=cfg.width,
                            intermediate_size=int(cfg.width * cfg.mlp_ratio), num_hidden_layers=cfg.layers,
                            num_attention_heads=cfg.heads, max_position_embeddings=length, hidden_act=cfg.hidden_act,
                            layer_norm_eps=LAYER_NORM_EPS, pad_token_id=pad_id, eos_token_id=eos_id,
                            bos_token_id=None, projection_size=cfg.width, attn_implementation="sdpa")


class SiglipVisionTower(nn.Module):
    kind = "vit"
    feature = "the attention-pooled (MAP head) post-norm patch tokens"
    saliency = "attention-pool probe attention"

    def __init__(self, config: SiglipVisionConfig, mean=None, std=None):
        super().__init__()
        self.model = SiglipVisionModel(config)
        self.width = config.hidden_size
        self.patch_dropout = 0.0  # not offered with the attention pool (config check); read by the trainer
        pixel_stats.add(self, mean, std)  # SigLIP's 0.5/0.5 normalisation, from CLIP's of the data layer

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, 3, H, W] normalised → the attention-pooling head's output [B, width]."""
        return self.model(pixel_values=pixel_stats.apply(self, pixels)).pooler_output

    @torch.no_grad()
    def attention_maps(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, heads, h, w]: each head's attention of the pooling probe over the patch grid (the weights
        that make the feature, as [CLS] attention does in CLIP's ViT)."""
        hidden = self.model(pixel_values=pixel_stats.apply(self, pixels)).last_hidden_state  # [B, N, width]
        pool = self.model.head
        probe = pool.probe.expand(len(hidden), -1, -1)
        _, weights = pool.attention(probe, hidden, hidden, need_weights=True, average_attn_weights=False)
        att = weights[:, :, 0]  # [B, heads, N]
        side = int(round(att.shape[-1] ** 0.5))
        return att.reshape(*att.shape[:2], side, side).float().cpu()

    def enable_grad_checkpointing(self) -> None:
        recompute.enable_hf(self.model)  # each encoder layer


class SiglipTextTower(nn.Module):
    def __init__(self, config: SiglipTextConfig):
        super().__init__()
        self.model = SiglipTextModel(config)
        self.width = config.projection_size

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids, mask [B, L] → head(final-norm last position) [B, width]. ``mask`` is not passed: SigLIP
        attends over the padding too (transformers' SiglipModel as its processor feeds it, and
        big_vision's training), so a mask would change the feature."""
        return self.model(input_ids=ids).pooler_output

    def enable_grad_checkpointing(self) -> None:
        recompute.enable_hf(self.model)  # each encoder layer
