"""nCLIP (Eq. 2-4, Algorithm 1), xCLIP (Eq. 5), nCLIP's zero-shot score and the head diagnostics."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from nclip import distributed as collectives
from nclip.defaults import NCLIP_SCORES
from nclip.objectives.functional._common import check_pair
from nclip.objectives.functional.clip import clip_terms

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
    if global_batch and collectives.is_distributed():
        lse = torch.logsumexp(collectives.gather_with_grad(lse[None]), dim=0)  # [W, K] -> [K]
        batch *= collectives.world_size()
    return lse - math.log(batch)


def entropy_terms(
    log_p_i: torch.Tensor, p_i: torch.Tensor, log_p_t: torch.Tensor, p_t: torch.Tensor, *, global_batch: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 3's regularisers of the image and text distributions p_I, p_T ([B, K], given with their
    logs): L_EH = −½ Σ_k (p_I log p_I + p_T log p_T), batch mean, and L_HE = −½ Σ_k (p̄_I log p̄_I +
    p̄_T log p̄_T) with p̄ the (global) batch mean. Shared by nCLIP, the unified objective (on its
    targets) and yCLIP; the caller's p is reused, so each objective's autograd graph is what it was."""
    eh = -((p_i * log_p_i).sum(1) + (p_t * log_p_t).sum(1)).mean() / 2
    log_pbar_i = batch_mean_log_prob(log_p_i, global_batch=global_batch)  # [K]
    log_pbar_t = batch_mean_log_prob(log_p_t, global_batch=global_batch)  # [K]
    he = -((log_pbar_i.exp() * log_pbar_i).sum() + (log_pbar_t.exp() * log_pbar_t).sum()) / 2
    return eh, he


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
    check_pair(image_logits, text_logits, "image_logits", "text_logits")
    log_p_i = F.log_softmax(image_logits, dim=1)  # [B, K]
    log_p_t = F.log_softmax(text_logits, dim=1)  # [B, K]
    p_i, p_t = log_p_i.exp(), log_p_t.exp()
    ce = -((p_i * log_p_t).sum(1) + (p_t * log_p_i).sum(1)).mean() / 2
    eh, he = entropy_terms(log_p_i, p_i, log_p_t, p_t, global_batch=global_batch)
    loss = ce + lambda1 * eh - lambda2 * he
    return {"loss": loss, "ce": ce, "eh": eh, "he": he, "kl": (ce - eh).detach()}


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
    clip_reduction: str = "mean",
) -> torch.Tensor:
    """xCLIP, Eq. (5): λ_CLIP·L_CLIP(g_I, g_T, σ) + λ_nCLIP·L_nCLIP(h_I, h_T, λ1, λ2).

    image_emb, text_emb: [B, D] CLIP-head outputs; image_logits, text_logits: [B, K] nCLIP-head
    outputs (the two heads are separate, Algorithm 1); logit_scale: the multiplier 1/σ;
    clip_reduction: L_CLIP's two directions averaged (Sec. 3.1) or summed (Algorithm 1).
    """
    clip = clip_terms(image_emb, text_emb, logit_scale, global_batch=global_batch, reduction=clip_reduction)["loss"]
    nclip = nclip_terms(image_logits, text_logits, lambda1, lambda2, global_batch=global_batch)["loss"]
    return w_clip * clip + w_nclip * nclip


def _check_score_logits(image_logits: torch.Tensor, text_logits: torch.Tensor, name: str) -> None:
    if image_logits.ndim != 2 or text_logits.ndim != 2:
        raise ValueError(f"{name} expects 2-D logits [N, K]")
    if image_logits.shape[1] != text_logits.shape[1]:
        raise ValueError(f"{name}: head widths differ ({image_logits.shape[1]} vs {text_logits.shape[1]})")


def nclip_similarity(
    image_logits: torch.Tensor, text_logits: torch.Tensor, score: str = "symmetric"
) -> torch.Tensor:
    """nCLIP's zero-shot score −L_CE (Sec. 3.1: "we utilize negative cross-entropy −L_CE as the
    similarity metric"), image_logits [N_img, K], text_logits [N_txt, K] → [N_img, N_txt], in float32
    (float64 inputs stay float64). Higher is more similar. With p_i = softmax(image_logits[i]) and
    q_j = softmax(text_logits[j]):

    ``symmetric`` (default): L_CE of Eq. (2) is "symmetrized as L_CLIP" (Sec. 3.1), i.e. the average of
        the two directions, so S[i, j] = −(CE(p_i, q_j) + CE(q_j, p_i)) / 2
        = ½ (Σ_k p_i,k log q_j,k + Σ_k q_j,k log p_i,k);
    ``image_to_text``: the one direction of Eq. (2) with the image as target,
        S[i, j] = −CE(p_i, q_j) = Σ_k p_i,k log q_j,k.
    """
    _check_score_logits(image_logits, text_logits, "nclip_similarity")
    if score not in NCLIP_SCORES:
        raise ValueError(f"nclip_similarity: score must be one of {NCLIP_SCORES}, got {score!r}")
    image_logits, text_logits = _at_least_float32(image_logits), _at_least_float32(text_logits)
    log_p = F.log_softmax(image_logits, dim=1)  # [N_img, K]
    log_q = F.log_softmax(text_logits, dim=1)  # [N_txt, K]
    i2t = log_p.exp() @ log_q.T  # [N_img, N_txt]: Σ_k p_i,k log q_j,k
    if score == "image_to_text":
        return i2t
    return (i2t + log_p @ log_q.exp().T) / 2  # + Σ_k q_j,k log p_i,k


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


# ============================================================================================
# Diagnostics of the distribution head: Acc_nC (Tab. B2), row/column std of P and of the logits
# (Fig. B1), usage
# ============================================================================================

@torch.no_grad()
def distribution_diagnostics(
    image_logits: torch.Tensor,
    text_logits: torch.Tensor,
    *,
    global_batch: bool = True,
    raw_logits: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Cheap, detached statistics of the nCLIP head (Appendix B.1, Fig. B1 and Tab. B2).

    Args:
        image_logits: [B, K] logits (or log-probabilities) of the images; P = softmax(image_logits).
        text_logits: [B, K] logits (or log-probabilities) of the texts.
        global_batch: reduce over all ranks when running distributed (no gradient flows).

    Returns, all over the global batch:
        ``acc_nC``: share of pairs whose image and text argmax prototypes agree (Tab. B2's Acc_nC,
            "the accuracy of nCLIP to predict the same one-hot assignment across the channel");
        ``row_std``: mean over samples i of std_k(P[i, k]), the population std over the K
            prototypes (0 for a uniform p_i; sqrt(K-1)/K for a one-hot p_i);
        ``col_std``: mean over prototypes k of std_i(P[i, k]), the population std over the batch
            (0 when every sample has the same distribution);
        ``usage``: fraction of the K prototypes that are the argmax of at least one image;
        ``logit_row_std``, ``logit_col_std``: the same two stds of the image logits themselves
            (``raw_logits`` when given, e.g. the logits behind targets passed as log-probabilities,
            else ``image_logits``). Fig. B1 (a)'s "Std converges to 1 if training is stable due to
            Batch Normalization" holds for these: the head's last BatchNorm(affine=False) makes
            every logit column of a training batch mean 0, variance 1, whereas a column of P
            (values in [0, 1], rows summing to 1) has std at most 1/2.
    P is the image side, as B.1's P = [p_1, ..., p_B]. Population (biased) stds keep every value
    defined for a batch of one.
    """
    check_pair(image_logits, text_logits, "image_logits", "text_logits")
    dist_on = global_batch and collectives.is_distributed()
    mean = collectives.all_reduce_mean_no_grad if dist_on else (lambda x: x)
    logits = image_logits.detach()
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    p = F.softmax(logits, dim=1)  # [B, K]
    arg_i = image_logits.detach().argmax(dim=1)  # [B]
    arg_t = text_logits.detach().argmax(dim=1)  # [B]
    acc = mean((arg_i == arg_t).float().mean())
    p_std = _row_col_std(p, mean, prefix="")  # global batch: col mean, then population variance
    row_std, col_std = p_std["row_std"], p_std["col_std"]
    # per-prototype argmax counts, [K]: a fixed-size scatter, not torch.bincount (which on CUDA
    # reads the labels' min and max on the host to size its output)
    counts = p.new_zeros(p.shape[1]).index_add_(0, arg_i, p.new_ones(arg_i.shape[0]))  # [K]
    if dist_on:
        counts = collectives.all_reduce_sum_no_grad(counts)
    usage = (counts > 0).float().mean()
    stats = {"acc_nC": acc, "row_std": row_std, "col_std": col_std, "usage": usage}
    raw = logits if raw_logits is None else _at_least_float32(raw_logits.detach())
    stats.update(_row_col_std(raw, mean, prefix="logit_"))
    return stats


def _row_col_std(x: torch.Tensor, mean, prefix: str) -> dict[str, torch.Tensor]:
    """Mean over rows of the std over columns and mean over columns of the std over the (global)
    batch, population stds of [B, K] ``x``; ``mean`` averages over ranks (identity on one)."""
    row_std = mean(x.std(dim=1, unbiased=False).mean())
    col_mean = mean(x.mean(dim=0))  # [K]
    col_std = mean((x - col_mean).square().mean(dim=0)).sqrt().mean()
    return {f"{prefix}row_std": row_std, f"{prefix}col_std": col_std}
