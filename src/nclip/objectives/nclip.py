"""nCLIP (xCLIP paper Eq. 4, Algorithm 1) and xCLIP (Eq. 5) as trainer objectives."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from nclip.batch import Batch
from nclip.objectives.base import BranchWeights, ClipReduction, EncoderOutput, EntropyWeights, Objective
from nclip.objectives.functional import clip_terms, distribution_diagnostics, nclip_terms


class NclipConfig(EntropyWeights):
    name: Literal["nclip"] = "nclip"


class XclipConfig(BranchWeights, ClipReduction, NclipConfig):
    name: Literal["xclip"] = "xclip"  # type: ignore[assignment]
    # Tab. 9f "warm-up on L_nCLIP": λ_nCLIP is 0 for the first nclip_warmup_start optimizer steps,
    # then ramps linearly to w_nclip over nclip_warmup_steps (nclip_weight_at); 0, 0: off (Eq. 5)
    nclip_warmup_start: int = Field(0, ge=0, title="nCLIP start",
                                    description="optimizer steps with λ_nCLIP = 0 before its ramp")
    nclip_warmup_steps: int = Field(0, ge=0, title="nCLIP ramp",
                                    description="optimizer steps of the linear ramp of λ_nCLIP from 0 to w_nclip")


def nclip_weight_at(step: int | None, base: float, start: int, ramp: int) -> float:
    """λ_nCLIP at the 0-based optimizer ``step``: the xCLIP paper's Tab. 9f warm-up ("we also add
    L_nCLIP after warm-up epochs with the linear scheduler to its base scale", Sec. 4.4) as

        λ(s) = base · clip((s − start) / ramp, 0, 1)        (ramp > 0)
        λ(s) = base · [s ≥ start]                            (ramp = 0)

    A pure function of the step, so a resumed run weighs every step as an uninterrupted one.
    ``step`` None (no trainer told the objective a step: evaluation, benchmarks): ``base``."""
    if step is None:
        return base
    if ramp == 0:
        return base if step >= start else 0.0
    return base * min(1.0, max(0.0, (step - start) / ramp))


def nclip_head_terms(out: EncoderOutput, cfg: EntropyWeights) -> dict[str, torch.Tensor]:
    """nCLIP's loss on the nCLIP head (Algorithm 1) with its terms as the paper names them (Fig. B1):
    ``loss``, ``L_CE``, ``L_EH``, ``L_HE``, ``L_KL`` (each the mean over both modalities) and the
    detached diagnostics (Tab. B2's ``acc_nC``, Fig. B1's ``row_std``/``col_std`` of P and
    ``logit_row_std``/``logit_col_std`` of the image logits, ``usage``).
    Shared by every objective that has an nCLIP head beside another loss (xCLIP, xSigLIP)."""
    terms = nclip_terms(out.image["nclip"], out.text["nclip"], cfg.lambda1, cfg.lambda2, global_batch=cfg.global_batch)
    named = {"L_CE": terms["ce"], "L_EH": terms["eh"], "L_HE": terms["he"], "L_KL": terms["kl"]}
    named.update(distribution_diagnostics(out.image["nclip"], out.text["nclip"], global_batch=cfg.global_batch))
    return {"loss": terms["loss"], **named}


class NclipObjective(Objective):
    heads = frozenset({"nclip"})
    zero_shot = "nclip"
    head_stats_prefix = "nclip"

    def __init__(self, cfg: NclipConfig):
        super().__init__()
        self.cfg = cfg

    def forward(self, out: EncoderOutput, batch: Batch | None = None):
        terms = nclip_head_terms(out, self.cfg)
        # + 0·s: nCLIP does not read the logit scale, but under DDP (find_unused_parameters off) a
        # parameter without a gradient leaves its gradient bucket un-averaged (and the next step
        # fails): give it a zero one, as ProtoCLIP's disabled terms do
        loss = terms.pop("loss") + 0.0 * out.logit_scale
        return {"loss": loss, **{f"nclip/{k}": v for k, v in terms.items()}}


class XclipObjective(Objective):
    """λ_CLIP·L_CLIP on the CLIP head + λ_nCLIP·L_nCLIP on the separate nCLIP head (Eq. 5).

    With the Tab. 9f warm-up (``nclip_warmup_start`` / ``nclip_warmup_steps``) λ_nCLIP is
    :func:`nclip_weight_at` of the step the trainer announced (:meth:`before_step`), logged as
    ``nclip/lambda``; a zero weight still back-propagates (zero gradients), so the nCLIP head takes
    part in every step, as distributed training needs."""

    heads = frozenset({"clip", "nclip"})
    zero_shot = "clip"  # Sec. 3.1: the cosine of CLIP's head transfers better zero-shot
    head_stats_prefix = "nclip"

    def __init__(self, cfg: XclipConfig):
        super().__init__()
        self.cfg = cfg
        # λ_nCLIP of the step the trainer announced, on the objective's device: set by a fill in
        # before_step (no host-to-device copy), read by the step as a tensor, so that a compiled step
        # neither specialises on the step nor recompiles as the weight ramps (not in checkpoints: a
        # pure function of the step)
        self.register_buffer("w_nclip_now", torch.tensor(float(cfg.w_nclip)), persistent=False)

    def before_step(self, step: int, total_steps: int) -> None:
        with torch.no_grad():
            self.w_nclip_now.fill_(nclip_weight_at(step, self.cfg.w_nclip, self.cfg.nclip_warmup_start,
                                                   self.cfg.nclip_warmup_steps))

    def forward(self, out: EncoderOutput, batch: Batch | None = None):
        cfg = self.cfg
        clip = clip_terms(out.image["clip"], out.text["clip"], out.logit_scale, global_batch=cfg.global_batch,
                          reduction=cfg.clip_reduction)
        nclip = nclip_head_terms(out, cfg)
        # float32(λ)·L, bitwise what a Python float λ gives (the scalar is cast to the loss's dtype)
        loss = cfg.w_clip * clip["loss"] + self.w_nclip_now * nclip["loss"]
        logged = {f"clip/{k}": v for k, v in clip.items()}
        logged.update({f"nclip/{k}": v for k, v in nclip.items()})
        if cfg.nclip_warmup_start or cfg.nclip_warmup_steps:
            logged["nclip/lambda"] = self.w_nclip_now.detach().clone()
        return {"loss": loss, **logged}
