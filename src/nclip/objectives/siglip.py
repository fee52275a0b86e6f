"""SigLIP (Zhai et al. 2023, "Sigmoid Loss for Language Image Pre-Training") and xSigLIP.

``siglip``: −(1/B) Σ_ij log σ(z_ij·(t·x_i·y_j + b)) on the CLIP head, z = +1 on the diagonal and −1
elsewhere, with a learnable bias b that is a parameter of this objective (the trainer optimises the
objective's parameters with the model's). SigLIP initialises t = 10 (t' = log 10) and b = −10; we
use the dual encoder's learnable logit scale as t, ``out.logit_scale`` (initialised to 1/0.07 ≈
14.3, i.e. ln(1/0.07) before the exp, clamped at 100), so one temperature parameter serves every
objective, and b starts at ``bias_init`` (−10 by default). Under DDP the bias's gradient must be
averaged like any parameter's (it receives each rank's local-rows gradient).

``xsiglip``: SigLIP in place of CLIP in xCLIP's Eq. 5, λ_CLIP·L_SigLIP(g_I, g_T) +
λ_nCLIP·L_nCLIP(h_I, h_T) on two separate heads, exactly as :class:`XclipObjective` combines them.

Hard negative captions (``data.hard_negative_key``, ``data.hard_negatives``): SigLIP scores each as one
more text, a pair with label −1 with every image (:func:`siglip_terms`). xSigLIP refuses them: its
nCLIP term is built from the pairs' cluster assignments, and a negative caption has no paired image
whose assignment it should predict.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from nclip.batch import Batch
from nclip.objectives.base import BranchWeights, EncoderOutput, EntropyWeights, Objective, ObjectiveConfig
from nclip.objectives.functional import siglip_terms
from nclip.objectives.hard_negatives import split_negatives
from nclip.objectives.nclip import nclip_head_terms


class SiglipConfig(ObjectiveConfig):
    name: Literal["siglip"] = "siglip"
    bias_init: float = Field(-10.0, description="initial learnable bias b (SigLIP: -10)")


class XsiglipConfig(BranchWeights, EntropyWeights, SiglipConfig):
    """xSigLIP: ``w_clip`` weighs the SigLIP loss (λ_CLIP of Eq. 5), ``w_nclip`` the nCLIP loss."""

    name: Literal["xsiglip"] = "xsiglip"  # type: ignore[assignment]


class SiglipObjective(Objective):
    heads = frozenset({"clip"})
    zero_shot = "clip"
    hard_negatives = True  # each negative caption a pair with label -1

    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.cfg = cfg
        self.logit_bias = nn.Parameter(torch.tensor(float(cfg.bias_init)))

    def _siglip(self, out: EncoderOutput, batch: Batch | None = None) -> dict[str, torch.Tensor]:
        text, negatives, negative_valid = split_negatives(out.text["clip"], batch)
        t = siglip_terms(out.image["clip"], text, out.logit_scale, self.logit_bias, global_batch=self.cfg.global_batch,
                         negatives=negatives, negative_valid=negative_valid)
        logged = {f"siglip/{k}": v for k, v in t.items() if k != "loss"}
        logged["siglip/logit_bias"] = self.logit_bias.detach()
        return {"loss": t["loss"], **logged}

    def forward(self, out: EncoderOutput, batch: Batch | None = None):
        return self._siglip(out, batch)


class XsiglipObjective(SiglipObjective):
    """λ_CLIP·L_SigLIP on the CLIP head + λ_nCLIP·L_nCLIP on the separate nCLIP head (Eq. 5)."""

    heads = frozenset({"clip", "nclip"})
    zero_shot = "clip"
    head_stats_prefix = "nclip"
    hard_negatives = False  # nCLIP's assignments: a negative caption has no paired image (module docstring)

    def __init__(self, cfg: XsiglipConfig):
        super().__init__(cfg)  # type: ignore[arg-type]

    def forward(self, out: EncoderOutput, batch: Batch | None = None):
        sig = self._siglip(out)
        sig_loss = sig.pop("loss")
        nclip = nclip_head_terms(out, self.cfg)
        loss = self.cfg.w_clip * sig_loss + self.cfg.w_nclip * nclip.pop("loss")
        return {"loss": loss, "siglip/L_SigLIP": sig_loss.detach(), **sig,
                **{f"nclip/{k}": v for k, v in nclip.items()}}
