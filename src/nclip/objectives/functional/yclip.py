"""yCLIP (App. B.2, Eq. 2-3): InfoNCE over a cross-entropy score matrix in one latent space."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nclip.objectives.functional._common import check_pair, global_rows
from nclip.objectives.functional.nclip import (
    distribution_diagnostics,
    entropy_terms,
    nclip_similarity,
)

# ============================================================================================
# yCLIP: InfoNCE over a cross-entropy score matrix in one shared latent space, App. B.2 Eq. 2-3
# ============================================================================================


def yclip_terms(
    image_logits: torch.Tensor,
    text_logits: torch.Tensor,
    logit_scale: torch.Tensor | float,
    lambda1: float = 0.5,
    lambda2: float = 1.5,
    *,
    global_batch: bool = True,
) -> dict[str, torch.Tensor]:
    """yCLIP (Appendix B.2): L_yCLIP = L_CE + λ1·L_EH − λ2·L_HE (Eq. 3) with the InfoNCE L_CE of Eq. 2.

    Args:
        image_logits: [B, K] outputs of the single (nCLIP) head for the images; P = softmax.
        text_logits: [B, K] the same head's outputs for the texts; Q = softmax.
        logit_scale: 1/σ (already exponentiated), the model's learnable temperature.
        lambda1, lambda2: weights of L_EH and L_HE (Eq. 3).
        global_batch: negatives from all ranks and p̄ over the global batch when distributed.

    Score matrix S = PᵀlogQ + (logP)ᵀQ, S_ij = p_i·log q_j + log p_i·q_j (image i, text j);
    ``nce`` = (INCE(S/σ) + INCE(Sᵀ/σ)) / 2, symmetrised like CLIP's Eq. 1 (the text→image rows
    are S_ji = q_j·log p_i + log q_j·p_i). Returns ``loss`` = nce + λ1·eh − λ2·he with
    ``eh``/``he`` as in :func:`nclip_terms`, and detached diagnostics: ``ce`` = −mean_i S_ii / 2
    (nCLIP's symmetrised L_CE on the positive pairs), ``kl`` = ce − eh, ``acc_i2t``/``acc_t2i``
    (Acc_C of Tab. B2 on S) and the :func:`distribution_diagnostics` (Acc_nC, row/col std, usage).
    """
    check_pair(image_logits, text_logits, "image_logits", "text_logits")
    log_p = F.log_softmax(image_logits, dim=1)  # [B, K]
    log_q = F.log_softmax(text_logits, dim=1)  # [B, K]
    p, q = log_p.exp(), log_q.exp()
    batch = log_p.shape[0]
    (all_log_p, all_log_q), offset = global_rows(log_p, log_q, global_batch=global_batch)  # [W·B, K]
    all_p, all_q = all_log_p.exp(), all_log_q.exp()
    targets = torch.arange(offset, offset + batch, device=log_p.device)
    s_i2t = p @ all_log_q.T + log_p @ all_q.T  # [B, W·B]: local images against every text
    s_t2i = q @ all_log_p.T + log_q @ all_p.T  # [B, W·B]: local texts against every image
    logits_i2t, logits_t2i = logit_scale * s_i2t, logit_scale * s_t2i
    nce = (F.cross_entropy(logits_i2t, targets) + F.cross_entropy(logits_t2i, targets)) / 2
    eh, he = entropy_terms(log_p, p, log_q, q, global_batch=global_batch)
    loss = nce + lambda1 * eh - lambda2 * he
    with torch.no_grad():
        ce = -s_i2t.gather(1, targets[:, None]).mean() / 2
        terms = {
            "ce": ce,
            "kl": ce - eh.detach(),
            "acc_i2t": (logits_i2t.argmax(1) == targets).float().mean(),
            "acc_t2i": (logits_t2i.argmax(1) == targets).float().mean(),
        }
    diag = distribution_diagnostics(image_logits, text_logits, global_batch=global_batch)
    return {"loss": loss, "nce": nce, "eh": eh, "he": he, **terms, **diag}


def yclip_similarity(image_logits: torch.Tensor, text_logits: torch.Tensor) -> torch.Tensor:
    """yCLIP's own score matrix S of App. B.2 Eq. 2 (the main text's Eq. 8 objective), used for its
    zero-shot classification and retrieval: S_ij = p_i·log q_j + log p_i·q_j, image_logits
    [N_img, K], text_logits [N_txt, K] → [N_img, N_txt] (without the 1/σ, which does not change a
    ranking). It is exactly twice nCLIP's symmetric −L_CE (:func:`nclip_similarity`), so both rank
    alike; the values are S's, as in training."""
    return 2 * nclip_similarity(image_logits, text_logits, "symmetric")
