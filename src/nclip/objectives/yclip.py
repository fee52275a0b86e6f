"""yCLIP (xCLIP paper, Appendix B.2, Eq. 2-3): contrastive and non-contrastive in ONE latent space.

One head (the nCLIP head) gives P = softmax(h_I) and Q = softmax(h_T); InfoNCE runs over the
cross-entropy score matrix (PᵀlogQ + logPᵀQ)/σ with the model's learnable σ, plus nCLIP's
entropy regularisers: L_yCLIP = L_CE + λ1·L_EH − λ2·L_HE. The paper finds the two objectives
conflict in a shared space (Tab. B2: 29.4% ZS at λ1 = 3, λ2 = 4 vs 42.4% for xCLIP); we keep it as
the ablation it is. Formulas: :func:`nclip.objectives.functional.yclip_terms`.
"""

from __future__ import annotations

from typing import Literal

from nclip.batch import Batch
from nclip.objectives.base import HEAD_STAT_KEYS, EncoderOutput, EntropyWeights, Objective
from nclip.objectives.functional import yclip_terms


class YclipConfig(EntropyWeights):
    """λ1, λ2 weigh L_EH and L_HE of Eq. 3; Tab. B2's rows use (0, 0), (0.5, 1.5) and (3, 4)."""

    name: Literal["yclip"] = "yclip"


class YclipObjective(Objective):
    heads = frozenset({"nclip"})
    # scored with its own S (App. B.2 Eq. 2; Eq. 8 of the main text trains on it), not nCLIP's −L_CE:
    # the "yclip" score reads the nCLIP head (nclip.objectives.scores.YclipScore)
    zero_shot = "yclip"
    head_stats_prefix = "yclip"

    def __init__(self, cfg: YclipConfig):
        super().__init__()
        self.cfg = cfg

    def forward(self, out: EncoderOutput, batch: Batch | None = None):
        t = yclip_terms(
            out.image["nclip"],
            out.text["nclip"],
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
            **{k: t[k] for k in HEAD_STAT_KEYS},
        }
        return {"loss": t["loss"], **{f"yclip/{k}": v for k, v in named.items()}}
