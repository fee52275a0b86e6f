"""CLIP's symmetric InfoNCE (xCLIP paper Eq. 1) as a trainer objective."""

from __future__ import annotations

from typing import Literal

from nclip.batch import Batch
from nclip.objectives import functional
from nclip.objectives.base import ClipReduction, EncoderOutput, Objective


class ClipConfig(ClipReduction):
    name: Literal["clip"] = "clip"


class ClipObjective(Objective):
    heads = frozenset({"clip"})
    zero_shot = "clip"

    def __init__(self, cfg: ClipConfig):
        super().__init__()
        self.cfg = cfg

    def forward(self, out: EncoderOutput, batch: Batch | None = None):
        cfg = self.cfg
        terms = functional.clip_terms(out.image["clip"], out.text["clip"], out.logit_scale,
                                      global_batch=cfg.global_batch, reduction=cfg.clip_reduction)
        return {"loss": terms["loss"], **{f"clip/{k}": v for k, v in terms.items()}}
