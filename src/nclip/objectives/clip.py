"""CLIP's symmetric InfoNCE (xCLIP paper Eq. 1) as a trainer objective; with several captions per image
(``data.caption_choice: all``) every caption of an image is one of its positives
(:func:`nclip.objectives.functional.clip_terms` on text [B, C, D]); hard negative captions
(``data.hard_negative_key``, ``data.hard_negatives``) join every image's image → text candidates
(NegCLIP)."""

from __future__ import annotations

from typing import Literal

from nclip.batch import Batch
from nclip.objectives import functional
from nclip.objectives.base import ClipReduction, EncoderOutput, Objective
from nclip.objectives.hard_negatives import split_negatives


class ClipConfig(ClipReduction):
    name: Literal["clip"] = "clip"


class ClipObjective(Objective):
    heads = frozenset({"clip"})
    zero_shot = "clip"
    several_captions = True  # data.caption_choice all: every caption of an image a positive
    hard_negatives = True  # NegCLIP: the negatives are more text candidates of image → text

    def __init__(self, cfg: ClipConfig):
        super().__init__()
        self.cfg = cfg

    def forward(self, out: EncoderOutput, batch: Batch | None = None):
        cfg = self.cfg
        text, negatives, negative_valid = split_negatives(out.text["clip"], batch)
        several = text.ndim == 3  # C caption slots per image: batch.caption_valid says which hold one
        terms = functional.clip_terms(out.image["clip"], text, out.logit_scale,
                                      global_batch=cfg.global_batch, reduction=cfg.clip_reduction,
                                      caption_valid=batch.caption_valid if several else None,
                                      negatives=negatives, negative_valid=negative_valid)
        return {"loss": terms["loss"], **{f"clip/{k}": v for k, v in terms.items()}}
