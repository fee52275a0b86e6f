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
    (all_i, all_t), offset = _global_rows(u_i, u_t, global_batch=global_batch)  # [W·B, D]
    targets = torch.arange(offset, offset + batch, device=u_i.device)
    logits_i2t = logit_scale * u_i @ all_t.T  # [B, W·B]: local images against every text
    logits_t2i = logit_scale * u_t @ all_i.T  # [B, W·B]: local texts against every image
    loss = (F.cross_entropy(logits_i2t, targets) + F.cross_entropy(logits_t2i, targets)) / 2
    terms = _pair_logit_stats(logits_i2t, targets)
    with torch.no_grad():
        terms["acc_t2i"] = (logits_t2i.argmax(1) == targets).float().mean()
    return {"loss": loss, **terms}


@torch.no_grad()
def _pair_logit_stats(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Diagnostics of a [B, N] image→text logit matrix whose row i pairs with column targets[i]:
    ``acc_i2t`` (Acc_C of Tab. B2), mean positive and mean negative logit."""
    pos = logits.gather(1, targets[:, None]).squeeze(1)
    neg = (logits.sum(1) - pos) / max(logits.shape[1] - 1, 1)
    return {
        "acc_i2t": (logits.argmax(1) == targets).float().mean(),
        "logit_pos": pos.mean(),
        "logit_neg": neg.mean(),
    }


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


def _global_rows(*xs: torch.Tensor, global_batch: bool) -> tuple[list[torch.Tensor], int]:
    """Every rank's rows of each [B, ...] tensor (gathered with gradient, rank order) and the
    offset of this rank's rows in them; the tensors themselves and offset 0 on one process."""
    if global_batch and D.is_distributed():
        return [D.gather_with_grad(x) for x in xs], D.rank() * xs[0].shape[0]
    return list(xs), 0


def _check_pair(a: torch.Tensor, b: torch.Tensor, name_a: str, name_b: str) -> None:
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"{name_a} and {name_b} must be 2-D [B, D], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape != b.shape:
        raise ValueError(f"{name_a} {tuple(a.shape)} and {name_b} {tuple(b.shape)} must have the same shape")
    if a.shape[0] == 0:
        raise ValueError("empty batch")


# ============================================================================================
# Diagnostics of the distribution head: Acc_nC (Tab. B2), row/column std of P (Fig. B1), usage
# ============================================================================================

__all__ += [
    "distribution_diagnostics",
    "sinkhorn",
    "batch_moments",
    "ema_moments",
    "unified_target_log_prob",
    "unified_terms",
    "unified_loss",
    "yclip_terms",
    "yclip_loss",
    "siglip_terms",
    "siglip_loss",
]

UNIFORM_CHOICES = ("none", "sinkhorn", "batch_softmax", "centering")


@torch.no_grad()
def distribution_diagnostics(
    image_logits: torch.Tensor, text_logits: torch.Tensor, *, global_batch: bool = True
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
        ``usage``: fraction of the K prototypes that are the argmax of at least one image.
    P is the image side, as B.1's P = [p_1, ..., p_B]. Population (biased) stds keep every value
    defined for a batch of one.
    """
    _check_pair(image_logits, text_logits, "image_logits", "text_logits")
    dist_on = global_batch and D.is_distributed()
    mean = D.all_reduce_mean_no_grad if dist_on else (lambda x: x)
    logits = image_logits.detach()
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    p = F.softmax(logits, dim=1)  # [B, K]
    arg_i = image_logits.detach().argmax(dim=1)  # [B]
    arg_t = text_logits.detach().argmax(dim=1)  # [B]
    acc = mean((arg_i == arg_t).float().mean())
    row_std = mean(p.std(dim=1, unbiased=False).mean())
    col_mean = mean(p.mean(dim=0))  # [K], global batch mean of each prototype's probability
    col_var = mean((p - col_mean).square().mean(dim=0))  # [K], global population variance
    col_std = col_var.sqrt().mean()
    counts = torch.bincount(arg_i, minlength=p.shape[1]).float()  # [K]
    if dist_on:
        counts = D.all_reduce_sum_no_grad(counts)
    usage = (counts > 0).float().mean()
    return {"acc_nC": acc, "row_std": row_std, "col_std": col_std, "usage": usage}


# ============================================================================================
# Unified non-contrastive objective: Appendix A, Algorithm 1 (Algorithm 2 of the main-text
# appendix), with the uniform(·) of SwAV (Sinkhorn), SCSF (batch-softmax), DINO (centering)
# ============================================================================================


def _global_logsumexp_over_batch_no_grad(x: torch.Tensor, global_batch: bool) -> torch.Tensor:
    """log Σ_i exp(x[i, k]) over the global batch, [B, K] -> [K], without gradient.

    This is the log of SwAV's all-reduced ``sum_of_rows``. Summing exp(x) directly overflows or
    underflows for sharp targets, so each rank's log-sum is exchanged instead (a no-grad gather of
    one [K] row per rank) and the W values are combined with logsumexp: the same number, always
    finite.
    """
    with torch.no_grad():
        lse = torch.logsumexp(x, dim=0)  # [K]
        if global_batch and D.is_distributed():
            lse = torch.logsumexp(D.gather_with_grad(lse[None]), dim=0)  # [W, K] -> [K]
    return lse


def _log_sinkhorn(log_scores: torch.Tensor, n_iters: int, global_batch: bool) -> torch.Tensor:
    """SwAV's ``distributed_sinkhorn`` in log space on scores already divided by ε. [B, K] -> log Q."""
    x = log_scores.detach()
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()  # SwAV runs Sinkhorn in float32
    k = x.shape[1]
    b = x.shape[0] * (D.world_size() if global_batch and D.is_distributed() else 1)
    # SwAV first divides Q by its total sum; the prototype step below removes any such constant.
    for _ in range(n_iters):
        # prototypes (rows of SwAV's K×B matrix): each sums to 1/K over the global batch
        x = x - _global_logsumexp_over_batch_no_grad(x, global_batch)[None, :] - math.log(k)
        # samples (columns of SwAV's K×B matrix): each sums to 1/B; local, no communication
        x = x - torch.logsumexp(x, dim=1, keepdim=True) - math.log(b)
    return x + math.log(b)  # SwAV's final Q *= B: every sample's assignment sums to 1


def sinkhorn(
    logits: torch.Tensor, n_iters: int = 3, epsilon: float = 0.05, *, global_batch: bool = True
) -> torch.Tensor:
    """SwAV's Sinkhorn-Knopp codes (Caron et al. 2020, Alg. 1 / ``distributed_sinkhorn``).

    Args:
        logits: [B, K] prototype scores (the target branch); detached here, Q carries no gradient.
        n_iters: Sinkhorn iterations (SwAV uses 3), each a prototype then a sample normalisation.
        epsilon: entropic regularisation; Q starts as exp(logits / ε).
        global_batch: the per-prototype sums run over all ranks' rows (no gradient).

    Returns Q [B, K] (no grad) in SwAV's convention after its final ``Q *= B``: every row (a
    sample's assignment) sums to exactly 1, and every column (a prototype) sums to B_global / K
    over the global batch up to the error of the finite iterations (equivalently, in SwAV's
    K×B notation before that rescaling: rows sum to 1/K, columns to 1/B). Computed in log space,
    so it is the same iteration as SwAV's but finite for arbitrarily sharp scores; half-precision
    inputs are computed in float32 and returned in their own dtype.
    """
    if logits.ndim != 2 or logits.shape[0] == 0:
        raise ValueError(f"sinkhorn expects non-empty 2-D logits [B, K], got {tuple(logits.shape)}")
    if n_iters < 1:
        raise ValueError(f"sinkhorn: n_iters must be >= 1, got {n_iters}")
    if not epsilon > 0:
        raise ValueError(f"sinkhorn: epsilon must be > 0, got {epsilon}")
    return _log_sinkhorn(logits.detach() / epsilon, n_iters, global_batch).exp().to(logits.dtype)


@torch.no_grad()
def batch_moments(logits: torch.Tensor, *, global_batch: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-prototype mean and population variance of [B, K] logits over the global batch (no grad).

    The mean is all-reduced first and the variance is then taken around it (one more all-reduce),
    which is exact for equal per-rank batches and avoids E[x²] − E[x]² cancellation.
    """
    x = logits.detach()
    dist_on = global_batch and D.is_distributed()
    mean = x.mean(dim=0)  # [K]
    if dist_on:
        mean = D.all_reduce_mean_no_grad(mean)
    var = (x - mean).square().mean(dim=0)  # [K]
    if dist_on:
        var = D.all_reduce_mean_no_grad(var)
    return mean, var


@torch.no_grad()
def ema_moments(
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    batch_mean: torch.Tensor,
    batch_var: torch.Tensor,
    momentum: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DINO's center update C ← m·C + (1 − m)·mean_batch, applied to the mean and the variance."""
    return (
        momentum * running_mean + (1 - momentum) * batch_mean,
        momentum * running_var + (1 - momentum) * batch_var,
    )


def unified_target_log_prob(
    logits: torch.Tensor,
    tau_s: float = 1.0,
    uniform: str = "none",
    *,
    sinkhorn_iters: int = 3,
    center: tuple[torch.Tensor, torch.Tensor] | None = None,
    center_eps: float = 1e-5,
    stop_grad: bool = False,
    global_batch: bool = True,
) -> torch.Tensor:
    """log p = log uniform(softmax(f / τ_s)) of Algorithm 1 (Appendix A), [B, K] -> [B, K].

    ``uniform`` (Tab. A1's "Smoothness" column):
        ``none``: p = softmax(f / τ_s) (CE, MSN, nCLIP rows).
        ``sinkhorn`` (SwAV): Sinkhorn applied to P = softmax(f / τ_s) (SwAV's exp(scores/ε) with
            scores = log P and ε = 1, so τ_s plays ε's role). The iterations run on detached
            targets (SwAV's ``torch.no_grad()``); they amount to constant per-sample and
            per-prototype factors, p_ik = a_i·b_k·softmax(f_i/τ_s)_k, and the returned log p has
            the value of log Q with the gradient of log softmax(f/τ_s), i.e. those factors held
            constant. So L_EH and L_HE keep a gradient, which Tab. A1's footnote * relies on
            (λ2 = 1 "necessary ... to avoid collapsing solutions"); ``stop_grad=True`` gives
            SwAV's fully detached codes instead.
        ``batch_softmax`` (SCSF): the softmax over the batch of log P (p(x|y) of Amrani &
            Bronstein 2022), renormalised over prototypes with a uniform prior:
            p_ik ∝ P_ik / Σ_j P_jk. Differentiable; the column sums are global-batch sums
            (:func:`batch_mean_log_prob`, exact gradients under DDP).
        ``centering`` (DINO, Tab. A1 footnote †: "performed before (instead of after) softmax";
            Appendix A: "additional running variance and scale parameters"):
            p = softmax(((f − μ) / sqrt(v + eps)) / τ_s) with the running mean μ and variance v
            given in ``center`` (constants: the statistics carry no gradient).
    ``stop_grad``: detach the target. Algorithm 1 has no stop-gradient (none of its lines
    29-40 detaches p) and Sec. 3.1 says "the target and prediction branch are backpropagated at
    the same time", so the default is False; True recovers the SSL originals' teacher detach.
    """
    if not tau_s > 0:
        raise ValueError(f"tau_s must be > 0, got {tau_s}")
    if uniform not in UNIFORM_CHOICES:
        raise ValueError(f"uniform must be one of {UNIFORM_CHOICES}, got {uniform!r}")
    z = logits
    if uniform == "centering":
        if center is None:
            raise ValueError("uniform='centering' needs center=(running_mean, running_var)")
        mean, var = center
        if mean.shape != logits.shape[1:] or var.shape != logits.shape[1:]:
            raise ValueError(
                f"center statistics {tuple(mean.shape)}/{tuple(var.shape)} do not match K={logits.shape[1]}"
            )
        z = (z - mean.detach()) * torch.rsqrt(var.detach() + center_eps)
    log_p = F.log_softmax(z / tau_s, dim=1)  # [B, K]
    if uniform == "sinkhorn":
        if sinkhorn_iters < 1:
            raise ValueError(f"sinkhorn_iters must be >= 1, got {sinkhorn_iters}")
        log_q = _log_sinkhorn(log_p, sinkhorn_iters, global_batch).to(log_p.dtype)
        log_p = log_p + (log_q - log_p.detach())  # value log Q, gradient of log softmax
    elif uniform == "batch_softmax":
        log_col = batch_mean_log_prob(log_p, global_batch=global_batch)  # [K] log Σ_j P_jk − log B
        log_p = F.log_softmax(log_p - log_col[None, :], dim=1)
    return log_p.detach() if stop_grad else log_p


def unified_terms(
    image_logits: torch.Tensor,
    text_logits: torch.Tensor,
    tau_s: float = 1.0,
    tau: float = 1.0,
    lambda1: float = 0.5,
    lambda2: float = 1.5,
    *,
    uniform: str = "none",
    sinkhorn_iters: int = 3,
    image_center: tuple[torch.Tensor, torch.Tensor] | None = None,
    text_center: tuple[torch.Tensor, torch.Tensor] | None = None,
    center_eps: float = 1e-5,
    stop_grad_target: bool = False,
    global_batch: bool = True,
) -> dict[str, torch.Tensor]:
    """The unified non-contrastive objective, Appendix A Algorithm 1, and its terms.

    Args:
        image_logits, text_logits: [B, K] nCLIP-head outputs f_I, f_T.
        tau_s: target temperature τ_s; tau: prediction temperature τ (Tab. A1 lists τ/τ_s).
        lambda1, lambda2: weights of L_EH and L_HE.
        uniform, sinkhorn_iters, center_eps, stop_grad_target: see
            :func:`unified_target_log_prob`; image_center / text_center: (mean [K], var [K])
            running statistics of each modality's logits for ``uniform='centering'``.
        global_batch: batch statistics (p̄, Sinkhorn and batch-softmax sums) over all ranks.

    With p = uniform(softmax(f/τ_s)) (targets) and q = softmax(f/τ) (predictions):
        L_CE = −(p_I·log q_T + p_T·log q_I), L_EH = −(p_I·log p_I + p_T·log p_T) (batch means),
        L_HE = −(p̄_I·log p̄_I + p̄_T·log p̄_T), loss = (L_CE + λ1·L_EH − λ2·L_HE) / 2,
    returned as the modality means ``ce``, ``eh``, ``he`` (so ``loss`` = ce + λ1·eh − λ2·he, as in
    :func:`nclip_terms`), ``kl`` = ce − eh (detached), and the detached diagnostics of
    :func:`distribution_diagnostics` computed on the targets p. The CE is cross-modal, as in the
    main text's transcription of the algorithm (p_I·log q_T + p_T·log q_I); the appendix copy
    prints p_I·log q_I, which would not couple the modalities at all. With τ_s = τ and
    uniform='none' this is exactly :func:`nclip_terms`.
    """
    _check_pair(image_logits, text_logits, "image_logits", "text_logits")
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    target = dict(
        tau_s=tau_s,
        uniform=uniform,
        sinkhorn_iters=sinkhorn_iters,
        center_eps=center_eps,
        stop_grad=stop_grad_target,
        global_batch=global_batch,
    )
    log_p_i = unified_target_log_prob(image_logits, center=image_center, **target)  # [B, K]
    log_p_t = unified_target_log_prob(text_logits, center=text_center, **target)  # [B, K]
    log_q_i = F.log_softmax(image_logits / tau, dim=1)  # [B, K]
    log_q_t = F.log_softmax(text_logits / tau, dim=1)  # [B, K]
    p_i, p_t = log_p_i.exp(), log_p_t.exp()
    ce = -((p_i * log_q_t).sum(1) + (p_t * log_q_i).sum(1)).mean() / 2
    eh = -((p_i * log_p_i).sum(1) + (p_t * log_p_t).sum(1)).mean() / 2
    log_pbar_i = batch_mean_log_prob(log_p_i, global_batch=global_batch)  # [K]
    log_pbar_t = batch_mean_log_prob(log_p_t, global_batch=global_batch)  # [K]
    he = -((log_pbar_i.exp() * log_pbar_i).sum() + (log_pbar_t.exp() * log_pbar_t).sum()) / 2
    loss = ce + lambda1 * eh - lambda2 * he
    diag = distribution_diagnostics(log_p_i, log_p_t, global_batch=global_batch)
    return {"loss": loss, "ce": ce, "eh": eh, "he": he, "kl": (ce - eh).detach(), **diag}


def unified_loss(
    image_logits: torch.Tensor,
    text_logits: torch.Tensor,
    tau_s: float = 1.0,
    tau: float = 1.0,
    lambda1: float = 0.5,
    lambda2: float = 1.5,
    **kwargs,
) -> torch.Tensor:
    """Algorithm 1's L_unified(f_I, f_T, τ_s, τ, λ1, λ2); keyword options of :func:`unified_terms`."""
    return unified_terms(image_logits, text_logits, tau_s, tau, lambda1, lambda2, **kwargs)["loss"]


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
    _check_pair(image_logits, text_logits, "image_logits", "text_logits")
    log_p = F.log_softmax(image_logits, dim=1)  # [B, K]
    log_q = F.log_softmax(text_logits, dim=1)  # [B, K]
    p, q = log_p.exp(), log_q.exp()
    batch = log_p.shape[0]
    (all_log_p, all_log_q), offset = _global_rows(log_p, log_q, global_batch=global_batch)  # [W·B, K]
    all_p, all_q = all_log_p.exp(), all_log_q.exp()
    targets = torch.arange(offset, offset + batch, device=log_p.device)
    s_i2t = p @ all_log_q.T + log_p @ all_q.T  # [B, W·B]: local images against every text
    s_t2i = q @ all_log_p.T + log_q @ all_p.T  # [B, W·B]: local texts against every image
    logits_i2t, logits_t2i = logit_scale * s_i2t, logit_scale * s_t2i
    nce = (F.cross_entropy(logits_i2t, targets) + F.cross_entropy(logits_t2i, targets)) / 2
    eh = -((p * log_p).sum(1) + (q * log_q).sum(1)).mean() / 2
    log_pbar = batch_mean_log_prob(log_p, global_batch=global_batch)  # [K]
    log_qbar = batch_mean_log_prob(log_q, global_batch=global_batch)  # [K]
    he = -((log_pbar.exp() * log_pbar).sum() + (log_qbar.exp() * log_qbar).sum()) / 2
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


def yclip_loss(
    image_logits: torch.Tensor,
    text_logits: torch.Tensor,
    logit_scale: torch.Tensor | float,
    lambda1: float = 0.5,
    lambda2: float = 1.5,
    *,
    global_batch: bool = True,
) -> torch.Tensor:
    """L_yCLIP of Appendix B.2, Eq. (3); see :func:`yclip_terms`."""
    return yclip_terms(image_logits, text_logits, logit_scale, lambda1, lambda2, global_batch=global_batch)[
        "loss"
    ]


# ============================================================================================
# SigLIP: pairwise sigmoid loss with a learnable bias (Zhai et al. 2023, Eq. 1 / Algorithm 1)
# ============================================================================================


def siglip_terms(
    image_emb: torch.Tensor,
    text_emb: torch.Tensor,
    logit_scale: torch.Tensor | float,
    logit_bias: torch.Tensor | float,
    *,
    global_batch: bool = True,
) -> dict[str, torch.Tensor]:
    """SigLIP: −(1/B) Σ_i Σ_j log σ(z_ij·(t·x_i·y_j + b)), z_ij = +1 for i = j, −1 otherwise.

    Args:
        image_emb: [B, D] image embeddings (L2-normalised inside, x_i).
        text_emb: [B, D] text embeddings (normalised inside, y_j).
        logit_scale: t, the multiplier, already exponentiated (SigLIP's t = exp(t')).
        logit_bias: b, a learnable scalar (SigLIP initialises it to −10).
        global_batch: every rank scores its local images against the texts of all ranks.

    Distributed: texts are gathered with gradient and each rank sums the loss of its B_local
    local image rows over all W·B_local texts, divided by the LOCAL batch size B_local. The mean
    over ranks of these per-rank losses is then (1/W)·Σ_r (1/B_local)·Σ_{i∈r} Σ_j ℓ_ij =
    (1/B_global)·Σ_i Σ_j ℓ_ij, the single-process loss on the whole batch, and under DDP's gradient
    averaging (plus the gather's summed backward) the gradients match as well.

    Returns ``loss`` and detached diagnostics ``acc_i2t`` (argmax over texts is the pair),
    ``logit_pos`` and ``logit_neg`` (mean positive and negative logits t·x·y + b).
    """
    _check_pair(image_emb, text_emb, "image_emb", "text_emb")
    x = F.normalize(image_emb, dim=-1)  # [B, D]
    y = F.normalize(text_emb, dim=-1)  # [B, D]
    batch = x.shape[0]
    (all_y,), offset = _global_rows(y, global_batch=global_batch)  # [W·B, D]
    logits = logit_scale * x @ all_y.T + logit_bias  # [B, W·B]
    targets = torch.arange(offset, offset + batch, device=x.device)
    signs = -torch.ones_like(logits)
    signs[torch.arange(batch, device=x.device), targets] = 1.0  # z_ij
    loss = -F.logsigmoid(signs * logits).sum() / batch
    return {"loss": loss, **_pair_logit_stats(logits, targets)}


def siglip_loss(
    image_emb: torch.Tensor,
    text_emb: torch.Tensor,
    logit_scale: torch.Tensor | float,
    logit_bias: torch.Tensor | float,
    *,
    global_batch: bool = True,
) -> torch.Tensor:
    """SigLIP's sigmoid loss (Zhai et al. 2023); image_emb, text_emb: [B, D]. See :func:`siglip_terms`."""
    return siglip_terms(image_emb, text_emb, logit_scale, logit_bias, global_batch=global_batch)["loss"]


# --------------------------------------------------------------------------------------------
# ProtoCLIP: Prototype Back Translation and the prototypical loss (implemented in prototype.py)
# --------------------------------------------------------------------------------------------

from nclip.objectives.prototype import pbt, proto_loss, proto_terms  # noqa: E402

__all__ += ["pbt", "proto_loss", "proto_terms"]
