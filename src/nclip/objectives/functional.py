"""Pure loss functions: nclip's public, tested objective API.

Notation follows "Non-Contrastive Learning Meets Language-Image Pre-Training" (xCLIP paper),
Sec. 3.1 and Algorithm 1: g, h are projected features of the two modalities, u = g/||g||,
p = softmax(g), q = softmax(h); B is the (global) batch size, K the nCLIP head width.

Global batch: when a process group with world size > 1 exists and ``global_batch=True``, every
batch statistic is computed over the union of all ranks' rows (InfoNCE negatives, the batch-mean
distribution p̄ of L_HE) through :mod:`nclip.distributed`, whose collectives give gradients that are
exact under DDP's gradient averaging. Each rank then returns the loss of its own rows, so the mean
of the per-rank losses equals the single-process loss on the whole batch.

Numerics: distributions are handled in log space (``log_softmax``; log p̄ through ``logsumexp``), so
every function is finite in float32 for logits of magnitude 1e4 and for a batch of one.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from nclip import distributed as D

__all__ = [
    "clip_loss",
    "clip_terms",
    "nclip_loss",
    "nclip_terms",
    "xclip_loss",
    "nclip_similarity",
    "batch_mean_log_prob",
]


# --------------------------------------------------------------------------------------------
# CLIP: symmetric InfoNCE, Eq. (1)
# --------------------------------------------------------------------------------------------


def clip_terms(
    image_emb: torch.Tensor,
    text_emb: torch.Tensor,
    logit_scale: torch.Tensor | float,
    *,
    global_batch: bool = True,
) -> dict[str, torch.Tensor]:
    """Symmetric InfoNCE (Eq. 1, Algorithm 1's L_CLIP) with diagnostics.

    Args:
        image_emb: [B, D] projected image features g_I (normalised inside).
        text_emb: [B, D] projected text features g_T (normalised inside).
        logit_scale: scalar multiplier 1/σ, already exponentiated.
        global_batch: use all ranks' rows as negatives when running distributed.

    Returns a dict with ``loss`` = (INCE(U_IᵀU_T/σ) + INCE(U_TᵀU_I/σ)) / 2 (the mean of both
    directions) and detached diagnostics: ``acc_i2t``, ``acc_t2i`` (Acc_C of Tab. B2, the share of
    rows whose paired sample has the highest logit), ``logit_pos`` and ``logit_neg`` (mean positive
    and negative logits).
    """
    _check_pair(image_emb, text_emb, "image_emb", "text_emb")
    u_i = F.normalize(image_emb, dim=-1)  # [B, D]
    u_t = F.normalize(text_emb, dim=-1)  # [B, D]
    batch = u_i.shape[0]
    if global_batch and D.is_distributed():
        all_i, all_t = D.gather_with_grad(u_i), D.gather_with_grad(u_t)  # [W·B, D]
        offset = D.rank() * batch
    else:
        all_i, all_t, offset = u_i, u_t, 0
    targets = torch.arange(offset, offset + batch, device=u_i.device)
    logits_i2t = logit_scale * u_i @ all_t.T  # [B, W·B]: local images against every text
    logits_t2i = logit_scale * u_t @ all_i.T  # [B, W·B]: local texts against every image
    loss = (F.cross_entropy(logits_i2t, targets) + F.cross_entropy(logits_t2i, targets)) / 2
    with torch.no_grad():
        pos = logits_i2t.gather(1, targets[:, None]).squeeze(1)
        n_neg = logits_i2t.shape[1] - 1
        neg = (logits_i2t.sum(1) - pos) / max(n_neg, 1)
        terms = {
            "acc_i2t": (logits_i2t.argmax(1) == targets).float().mean(),
            "acc_t2i": (logits_t2i.argmax(1) == targets).float().mean(),
            "logit_pos": pos.mean(),
            "logit_neg": neg.mean(),
        }
    return {"loss": loss, **terms}


def clip_loss(
    image_emb: torch.Tensor,
    text_emb: torch.Tensor,
    logit_scale: torch.Tensor | float,
    *,
    global_batch: bool = True,
) -> torch.Tensor:
    """Symmetric InfoNCE, Eq. (1): the mean of the image→text and text→image cross-entropies.

    image_emb, text_emb: [B, D], L2-normalised inside; logit_scale: the multiplier 1/σ.
    """
    return clip_terms(image_emb, text_emb, logit_scale, global_batch=global_batch)["loss"]


# --------------------------------------------------------------------------------------------
# nCLIP: cross-entropy between cluster assignments with entropy regularisers, Eq. (2)-(4)
# --------------------------------------------------------------------------------------------


def batch_mean_log_prob(log_p: torch.Tensor, *, global_batch: bool = True) -> torch.Tensor:
    """log p̄ for p̄ = (1/B) Σ_i p_i (Eq. 3), from log-probabilities [B, K], stably.

    log p̄_k = logsumexp_i(log p_ik) − log B, so p̄ never underflows to a 0 whose log would be
    -inf. Distributed, the per-rank logsumexp rows are gathered (differentiably) and reduced, so p̄
    is the mean over the global batch (every rank must hold the same number of rows).
    """
    lse = torch.logsumexp(log_p, dim=0)  # [K]
    batch = log_p.shape[0]
    if global_batch and D.is_distributed():
        lse = torch.logsumexp(D.gather_with_grad(lse[None]), dim=0)  # [W, K] -> [K]
        batch *= D.world_size()
    return lse - math.log(batch)


def nclip_terms(
    image_logits: torch.Tensor,
    text_logits: torch.Tensor,
    lambda1: float = 0.5,
    lambda2: float = 1.5,
    *,
    global_batch: bool = True,
) -> dict[str, torch.Tensor]:
    """nCLIP's objective (Eq. 4, Algorithm 1) and its terms, each symmetrised by averaging.

    Args:
        image_logits: [B, K] nCLIP head outputs of the images (h_I in Algorithm 1).
        text_logits: [B, K] nCLIP head outputs of the texts (h_T).
        lambda1: weight of the entropy term L_EH (sharpness).
        lambda2: weight of the mean-entropy term L_HE (smoothness), subtracted.
        global_batch: average p̄ over all ranks when running distributed (Sec. 4.3, batch size).

    Returns a dict with
        ``loss`` = L_CE + λ1·L_EH − λ2·L_HE, which equals Algorithm 1's L/2 (its terms are sums over
        the two modalities, ours are their means);
        ``ce`` = −½ Σ_k (p_I log p_T + p_T log p_I), batch mean (Eq. 2, symmetrised);
        ``eh`` = −½ Σ_k (p_I log p_I + p_T log p_T), batch mean (Eq. 3, left);
        ``he`` = −½ Σ_k (p̄_I log p̄_I + p̄_T log p̄_T) (Eq. 3, right);
        ``kl`` = ce − eh, the symmetrised KL(p_I‖p_T)/KL(p_T‖p_I) mean.
    For collapsed inputs (every distribution uniform) ce = eh = he = ln K.
    """
    _check_pair(image_logits, text_logits, "image_logits", "text_logits")
    log_p_i = F.log_softmax(image_logits, dim=1)  # [B, K]
    log_p_t = F.log_softmax(text_logits, dim=1)  # [B, K]
    p_i, p_t = log_p_i.exp(), log_p_t.exp()
    ce = -((p_i * log_p_t).sum(1) + (p_t * log_p_i).sum(1)).mean() / 2
    eh = -((p_i * log_p_i).sum(1) + (p_t * log_p_t).sum(1)).mean() / 2
    log_pbar_i = batch_mean_log_prob(log_p_i, global_batch=global_batch)  # [K]
    log_pbar_t = batch_mean_log_prob(log_p_t, global_batch=global_batch)  # [K]
    he = -((log_pbar_i.exp() * log_pbar_i).sum() + (log_pbar_t.exp() * log_pbar_t).sum()) / 2
    loss = ce + lambda1 * eh - lambda2 * he
    return {"loss": loss, "ce": ce, "eh": eh, "he": he, "kl": (ce - eh).detach()}


def nclip_loss(
    image_logits: torch.Tensor,
    text_logits: torch.Tensor,
    lambda1: float = 0.5,
    lambda2: float = 1.5,
    *,
    global_batch: bool = True,
) -> torch.Tensor:
    """Algorithm 1's L_nCLIP: (L_CE + λ1·L_EH − λ2·L_HE) / 2 with each term summed over both
    modalities; image_logits, text_logits: [B, K] nCLIP head outputs. See :func:`nclip_terms`."""
    return nclip_terms(image_logits, text_logits, lambda1, lambda2, global_batch=global_batch)[
        "loss"
    ]


def xclip_loss(
    image_emb: torch.Tensor,
    text_emb: torch.Tensor,
    image_logits: torch.Tensor,
    text_logits: torch.Tensor,
    logit_scale: torch.Tensor | float,
    w_clip: float = 0.2,
    w_nclip: float = 1.0,
    lambda1: float = 0.5,
    lambda2: float = 1.5,
    *,
    global_batch: bool = True,
) -> torch.Tensor:
    """xCLIP, Eq. (5): λ_CLIP·L_CLIP(g_I, g_T, σ) + λ_nCLIP·L_nCLIP(h_I, h_T, λ1, λ2).

    image_emb, text_emb: [B, D] CLIP-head outputs; image_logits, text_logits: [B, K] nCLIP-head
    outputs (the two heads are separate, Algorithm 1); logit_scale: the multiplier 1/σ.
    """
    clip = clip_loss(image_emb, text_emb, logit_scale, global_batch=global_batch)
    nclip = nclip_loss(image_logits, text_logits, lambda1, lambda2, global_batch=global_batch)
    return w_clip * clip + w_nclip * nclip


def nclip_similarity(image_logits: torch.Tensor, text_logits: torch.Tensor) -> torch.Tensor:
    """nCLIP's zero-shot score −L_CE (Sec. 3.1): S[i, j] = Σ_k p_i,k · log q_j,k.

    image_logits: [N_img, K], text_logits: [N_txt, K] → [N_img, N_txt]. Higher is more similar.
    """
    if image_logits.ndim != 2 or text_logits.ndim != 2:
        raise ValueError("nclip_similarity expects 2-D logits [N, K]")
    if image_logits.shape[1] != text_logits.shape[1]:
        raise ValueError(
            f"nclip_similarity: head widths differ ({image_logits.shape[1]} vs {text_logits.shape[1]})"
        )
    p_img = F.softmax(image_logits, dim=1)  # [N_img, K]
    log_q = F.log_softmax(text_logits, dim=1)  # [N_txt, K]
    return p_img @ log_q.T


def _check_pair(a: torch.Tensor, b: torch.Tensor, name_a: str, name_b: str) -> None:
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"{name_a} and {name_b} must be 2-D [B, D], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape != b.shape:
        raise ValueError(f"{name_a} {tuple(a.shape)} and {name_b} {tuple(b.shape)} must have the same shape")
    if a.shape[0] == 0:
        raise ValueError("empty batch")
