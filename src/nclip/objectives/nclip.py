"""nCLIP (xCLIP paper Eq. 4, Algorithm 1) and xCLIP (Eq. 5) as trainer objectives."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from nclip.objectives import functional as Fn
from nclip.objectives.base import EncoderOutput, Objective, ObjectiveConfig


class NclipConfig(ObjectiveConfig):
    name: Literal["nclip"] = "nclip"
    lambda1: float = Field(0.5, ge=0, description="weight of L_EH (Eq. 4)")
    lambda2: float = Field(1.5, ge=0, description="weight of L_HE (Eq. 4); λ1 = λ2 − 1 is stable")


class XclipConfig(NclipConfig):
    name: Literal["xclip"] = "xclip"  # type: ignore[assignment]
    w_clip: float = Field(0.2, ge=0, description="λ_CLIP of Eq. 5")
    w_nclip: float = Field(1.0, ge=0, description="λ_nCLIP of Eq. 5")


def _nclip_terms(out: EncoderOutput, cfg: NclipConfig) -> dict:
    terms = Fn.nclip_terms(
        out.image_logits, out.text_logits, cfg.lambda1, cfg.lambda2, global_batch=cfg.global_batch
    )
    # L_CE, L_EH, L_HE, L_KL as named in the paper (Fig. B1), each the mean over both modalities.
    named = {"L_CE": terms["ce"], "L_EH": terms["eh"], "L_HE": terms["he"], "L_KL": terms["kl"]}
    # detached diagnostics (Tab. B2's Acc_nC, Fig. B1's row/column std of P, prototype usage)
    named.update(Fn.distribution_diagnostics(out.image_logits, out.text_logits, global_batch=cfg.global_batch))
    return {"loss": terms["loss"], **named}


class NclipObjective(Objective):
    heads = frozenset({"nclip"})
    zero_shot_head = "nclip"

    def __init__(self, cfg: NclipConfig):
        super().__init__()
        self.cfg = cfg

    def forward(self, out: EncoderOutput):
        terms = _nclip_terms(out, self.cfg)
        return {"loss": terms.pop("loss"), **{f"nclip/{k}": v for k, v in terms.items()}}


class XclipObjective(Objective):
    """λ_CLIP·L_CLIP on the CLIP head + λ_nCLIP·L_nCLIP on the separate nCLIP head (Eq. 5)."""

    heads = frozenset({"clip", "nclip"})
    zero_shot_head = "clip"  # Sec. 3.1: the cosine of CLIP's head transfers better zero-shot

    def __init__(self, cfg: XclipConfig):
        super().__init__()
        self.cfg = cfg

    def forward(self, out: EncoderOutput):
        clip = Fn.clip_terms(out.image_emb, out.text_emb, out.logit_scale, global_batch=self.cfg.global_batch)
        nclip = _nclip_terms(out, self.cfg)
        loss = self.cfg.w_clip * clip["loss"] + self.cfg.w_nclip * nclip["loss"]
        logged = {f"clip/{k}": v for k, v in clip.items()}
        logged.update({f"nclip/{k}": v for k, v in nclip.items()})
        return {"loss": loss, **logged}
