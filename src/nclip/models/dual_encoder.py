"""The dual encoder: two towers, a CLIP head and/or an nCLIP head (and/or a ProtoCLIP head on top of
the CLIP head) per modality, a logit scale."""

from __future__ import annotations

import math

import torch
from torch import nn

from nclip.config import RunConfig
from nclip.data.tokenization import CaptionTokenizer
from nclip.models.heads import NclipHead, ProtoHead, clip_head
from nclip.models.towers import build_text_tower, build_vision_tower
from nclip.objectives import REGISTRY
from nclip.objectives.base import EncoderOutput

LOGIT_SCALE_INIT = math.log(1 / 0.07)  # CLIP's σ = 0.07
LOGIT_SCALE_MAX = math.log(100.0)


class DualEncoder(nn.Module):
    """f = enc(x); g = proj_CLIP(f); h = proj_nCLIP(f) for each modality (Algorithm 1)."""

    LOGIT_SCALE_MAX = LOGIT_SCALE_MAX

    def __init__(self, cfg: RunConfig, heads: frozenset[str], pretrained_text: bool = True):
        super().__init__()
        self.heads = frozenset(heads)
        m = cfg.model
        self.cfg_text_kind = m.text.kind
        self.tokenizer = CaptionTokenizer(cfg.data.text_length)
        self.vision = build_vision_tower(m.vision, cfg.data.image_size)
        self.text = build_text_tower(m, self.tokenizer, cfg.data.text_length, pretrained_text)
        if "clip" in self.heads:
            self.image_clip_head = clip_head(self.vision.width, m.embed_dim)
            self.text_clip_head = clip_head(self.text.width, m.embed_dim)
        if "nclip" in self.heads:
            self.image_nclip_head = NclipHead(self.vision.width, m.nclip_hidden, m.nclip_dim)
            self.text_nclip_head = NclipHead(self.text.width, m.nclip_hidden, m.nclip_dim)
        if "proto" in self.heads:  # ProtoCLIP: h = g(z) on the CLIP embedding z (its Fig. 2)
            if "clip" not in self.heads:
                raise ValueError("the proto head sits on the CLIP head: heads must include 'clip'")
            self.image_proto_head = ProtoHead(m.embed_dim, m.proto_hidden, m.proto_dim)
            self.text_proto_head = ProtoHead(m.embed_dim, m.proto_hidden, m.proto_dim)
        # learnable s with σ = exp(-s), initialised to ln(1/0.07) and clamped to ln(100) (CLIP)
        self.logit_scale = nn.Parameter(torch.tensor(LOGIT_SCALE_INIT))

    def scale(self) -> torch.Tensor:
        return self.logit_scale.clamp(max=LOGIT_SCALE_MAX).exp()

    def encode_image(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """pixels [B, 3, H, W] → {"features": f [B, d], "emb": g [B, D], "logits": h [B, K],
        "proto": [B, d_h]} (the keys of the heads the model has)."""
        f = self.vision(pixels)
        return self._project(f, "image")

    def encode_text(self, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """ids, mask [B, L] → {"features": f [B, d], "emb": g [B, D], "logits": h [B, K]}."""
        f = self.text(ids, mask)
        return self._project(f, "text")

    def _project(self, f: torch.Tensor, modality: str) -> dict[str, torch.Tensor]:
        out = {"features": f}
        if "clip" in self.heads:
            out["emb"] = getattr(self, f"{modality}_clip_head")(f)
        if "nclip" in self.heads:
            out["logits"] = getattr(self, f"{modality}_nclip_head")(f)
        if "proto" in self.heads:
            out["proto"] = getattr(self, f"{modality}_proto_head")(out["emb"])
        return out

    def forward(self, pixels: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> EncoderOutput:
        img, txt = self.encode_image(pixels), self.encode_text(ids, mask)
        return EncoderOutput(
            image_features=img["features"],
            text_features=txt["features"],
            image_emb=img.get("emb"),
            text_emb=txt.get("emb"),
            image_logits=img.get("logits"),
            text_logits=txt.get("logits"),
            logit_scale=self.scale(),
            image_proto=img.get("proto"),
            text_proto=txt.get("proto"),
        )


def build_model(cfg: RunConfig, pretrained_text: bool = True) -> DualEncoder:
    """The dual encoder with the heads that the configured objective needs."""
    heads = REGISTRY[cfg.objective.name][1].heads
    return DualEncoder(cfg, heads, pretrained_text=pretrained_text)
