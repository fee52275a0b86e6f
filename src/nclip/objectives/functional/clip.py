"""CLIP: symmetric InfoNCE (xCLIP paper Eq. 1).

The paper joins the two directions two ways: Sec. 3.1's prose takes "the average of two terms", its
Algorithm 1 returns INCE(U_IᵀU_T/σ) + INCE(U_TᵀU_I/σ), the sum, while L_nCLIP beside it returns L/2.
Under Eq. 5 the readings weigh L_CLIP by a factor 2 apart (λ_CLIP = 0.2 with the sum is λ_CLIP = 0.4
with the mean). ``reduction`` picks one (``objective.clip_reduction``); ``"mean"`` is the default.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nclip.objectives.functional._common import check_pair, global_rows, pair_logit_stats

# --------------------------------------------------------------------------------------------
# CLIP: symmetric InfoNCE, Eq. (1)
# --------------------------------------------------------------------------------------------

# how L_CLIP joins its two InfoNCE directions: "mean" (Sec. 3.1's prose), "sum" (Algorithm 1)
CLIP_REDUCTIONS = ("mean", "sum")


def check_clip_reduction(reduction: str) -> None:
    if reduction not in CLIP_REDUCTIONS:
        raise ValueError(f"clip reduction {reduction!r} is not one of {', '.join(CLIP_REDUCTIONS)}")


def clip_terms(
    image_emb: torch.Tensor,
    text_emb: torch.Tensor,
    logit_scale: torch.Tensor | float,
    *,
    global_batch: bool = True,
    reduction: str = "mean",
) -> dict[str, torch.Tensor]:
    """Symmetric InfoNCE (Eq. 1, Algorithm 1's L_CLIP) with diagnostics.

    Args:
        image_emb: [B, D] projected image features g_I (normalised inside).
        text_emb: [B, D] projected text features g_T (normalised inside).
        logit_scale: scalar multiplier 1/σ, already exponentiated.
        global_batch: use all ranks' rows as negatives when running distributed.
        reduction: ``"mean"`` of the two directions (Sec. 3.1) or their ``"sum"`` (Algorithm 1).

    Returns a dict with ``loss`` = INCE(U_IᵀU_T/σ) + INCE(U_TᵀU_I/σ), divided by 2 under
    ``"mean"`` (L_CLIP as it enters Eq. 5, before λ_CLIP), and detached diagnostics: ``acc_i2t``,
    ``acc_t2i`` (Acc_C of Tab. B2, the share of rows whose paired sample has the highest logit),
    ``logit_pos`` and ``logit_neg`` (mean positive and negative logits).
    """
    check_pair(image_emb, text_emb, "image_emb", "text_emb")
    check_clip_reduction(reduction)
    u_i = F.normalize(image_emb, dim=-1)  # [B, D]
    u_t = F.normalize(text_emb, dim=-1)  # [B, D]
    batch = u_i.shape[0]
    (all_i, all_t), offset = global_rows(u_i, u_t, global_batch=global_batch)  # [W·B, D]
    targets = torch.arange(offset, offset + batch, device=u_i.device)
    logits_i2t = logit_scale * u_i @ all_t.T  # [B, W·B]: local images against every text
    logits_t2i = logit_scale * u_t @ all_i.T  # [B, W·B]: local texts against every image
    loss = F.cross_entropy(logits_i2t, targets) + F.cross_entropy(logits_t2i, targets)
    if reduction == "mean":
        loss = loss / 2
    terms = pair_logit_stats(logits_i2t, targets)
    with torch.no_grad():
        terms["acc_t2i"] = (logits_t2i.argmax(1) == targets).float().mean()
    return {"loss": loss, **terms}


