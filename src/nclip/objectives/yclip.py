"""yCLIP (xCLIP paper, Appendix B.2, Eq. 2-3): contrastive and non-contrastive in ONE latent space.

One head (the nCLIP head) gives P = softmax(h_I) and Q = softmax(h_T); InfoNCE runs over the
cross-entropy score matrix (PᵀlogQ + logPᵀQ)/σ with the model's learnable σ, plus nCLIP's
entropy regularisers: L_yCLIP = L_CE + λ1·L_EH − λ2·L_HE. The paper finds the two objectives
conflict in a shared space (Tab. B2: 29.4% ZS at λ1 = 3, λ2 = 4 vs 42.4% for xCLIP); we keep it as
the ablation it is. Formulas: :func:`nclip.objectives.functional.yclip_terms`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from nclip.objectives import functional as Fn
from nclip.objectives.base import EncoderOutput, Objective, ObjectiveConfig


class YclipConfig(ObjectiveConfig):
    name: Literal["yclip"] = "yclip"
    lambda1: float = Field(0.5, ge=0, description="weight of L_EH (Eq. 3); Tab. B2 rows: 0, 0.5, 3")
    lambda2: float = Field(1.5, ge=0, description="weight of L_HE (Eq. 3); Tab. B2 rows: 0, 1.5, 4")


class YclipObjective(Objective):
    heads = frozenset({"nclip"})
    zero_shot_head = "nclip"

    def __init__(self, cfg: YclipConfig):
        super().__init__()
        self.cfg = cfg

    def forward(self, out: EncoderOutput):
        t = Fn.yclip_terms(
            out.image_logits,
            out.text_logits,
            out.logit_scale,
            self.cfg.lambda1,
            self.cfg.lambda2,
            global_batch=self.cfg.global_batch,
        )
        named = {
            "L_NCE": t["nce"],  # Eq. 2, the InfoNCE over the score matrix
            "L_CE": t["ce"],  # nCLIP's L_CE on the positive pairs (detached, for comparison)
            "L_EH": t["eh"],
            "L_HE": t["he"],
            "L_KL": t["kl"],
            "acc_i2t": t["acc_i2t"],  # Acc_C of Tab. B2
            "acc_t2i": t["acc_t2i"],
            **{k: t[k] for k in ("acc_nC", "row_std", "col_std", "usage")},
        }
        return {"loss": t["loss"], **{f"yclip/{k}": v for k, v in named.items()}}
