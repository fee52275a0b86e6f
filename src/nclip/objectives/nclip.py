"""nCLIP (xCLIP paper Eq. 4, Algorithm 1) and xCLIP (Eq. 5) as trainer objectives."""

from __future__ import annotations

from typing import Literal

import torch

from nclip.objectives.base import BranchWeights, EncoderOutput, EntropyWeights, Objective
from nclip.objectives.functional import clip_terms, distribution_diagnostics, nclip_terms


class NclipConfig(EntropyWeights):
    name: Literal["nclip"] = "nclip"


class XclipConfig(BranchWeights, NclipConfig):
    name: Literal["xclip"] = "xclip"  # type: ignore[assignment]


def nclip_head_terms(out: EncoderOutput, cfg: EntropyWeights) -> dict[str, torch.Tensor]:
    """nCLIP's loss on the nCLIP head (Algorithm 1) with its terms as the paper names them (Fig. B1):
    ``loss``, ``L_CE``, ``L_EH``, ``L_HE``, ``L_KL`` (each the mean over both modalities) and the
    detached diagnostics (Tab. B2's ``acc_nC``, Fig. B1's ``row_std``/``col_std`` of P and
    ``logit_row_std``/``logit_col_std`` of the image logits, ``usage``).
    Shared by every objective that has an nCLIP head beside another loss (xCLIP, xSigLIP)."""
    terms = nclip_terms(out.image_logits, out.text_logits, cfg.lambda1, cfg.lambda2, global_batch=cfg.global_batch)
    named = {"L_CE": terms["ce"], "L_EH": terms["eh"], "L_HE": terms["he"], "L_KL": terms["kl"]}
    named.update(distribution_diagnostics(out.image_logits, out.text_logits, global_batch=cfg.global_batch))
    return {"loss": terms["loss"], **named}


class NclipObjective(Objective):
    heads = frozenset({"nclip"})
    zero_shot_head = "nclip"
    head_stats_prefix = "nclip"

    def __init__(self, cfg: NclipConfig):
        super().__init__()
        self.cfg = cfg

    def forward(self, out: EncoderOutput):
        terms = nclip_head_terms(out, self.cfg)
        return {"loss": terms.pop("loss"), **{f"nclip/{k}": v for k, v in terms.items()}}


class XclipObjective(Objective):
    """λ_CLIP·L_CLIP on the CLIP head + λ_nCLIP·L_nCLIP on the separate nCLIP head (Eq. 5)."""

    heads = frozenset({"clip", "nclip"})
    zero_shot_head = "clip"  # Sec. 3.1: the cosine of CLIP's head transfers better zero-shot
    head_stats_prefix = "nclip"

    def __init__(self, cfg: XclipConfig):
        super().__init__()
        self.cfg = cfg

    def forward(self, out: EncoderOutput):
        clip = clip_terms(out.image_emb, out.text_emb, out.logit_scale, global_batch=self.cfg.global_batch)
        nclip = nclip_head_terms(out, self.cfg)
        loss = self.cfg.w_clip * clip["loss"] + self.cfg.w_nclip * nclip["loss"]
        logged = {f"clip/{k}": v for k, v in clip.items()}
        logged.update({f"nclip/{k}": v for k, v in nclip.items()})
        return {"loss": loss, **logged}
