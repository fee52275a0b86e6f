"""Appendix A's unified non-contrastive objective (Algorithm 1): Sinkhorn, batch-softmax, centering."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from nclip import distributed as collectives
from nclip.objectives.functional._common import check_pair
from nclip.objectives.functional.nclip import batch_mean_log_prob, distribution_diagnostics, entropy_terms

UNIFORM_CHOICES = ("none", "sinkhorn", "batch_softmax", "centering")


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
        if global_batch and collectives.is_distributed():
            lse = torch.logsumexp(collectives.gather_with_grad(lse[None]), dim=0)  # [W, K] -> [K]
    return lse


def _log_sinkhorn(log_scores: torch.Tensor, n_iters: int, global_batch: bool) -> torch.Tensor:
    """SwAV's ``distributed_sinkhorn`` in log space on scores already divided by ε. [B, K] -> log Q."""
    x = log_scores.detach()
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()  # SwAV runs Sinkhorn in float32
    k = x.shape[1]
    b = x.shape[0] * (collectives.world_size() if global_batch and collectives.is_distributed() else 1)
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
    dist_on = global_batch and collectives.is_distributed()
    mean = x.mean(dim=0)  # [K]
    if dist_on:
        mean = collectives.all_reduce_mean_no_grad(mean)
    var = (x - mean).square().mean(dim=0)  # [K]
    if dist_on:
        var = collectives.all_reduce_mean_no_grad(var)
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
    center: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
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
        ``centering`` (DINO, Tab. A1 footnote †: "Centering is performed in practice before
            (instead of after) softmax"; Appendix A: "For Centering, we use additional running
            variance and scale parameters to uniform the target probability, which yields more
            stable training compared to the original [DINO] with a running mean only"):
            p = softmax(γ ⊙ (f − μ) / sqrt(v + eps) / τ_s), ``center`` = (μ, v, γ), each [K]: the
            running mean μ and running variance v (constants: no gradient) and the scale
            parameters γ (learnable, with gradient). The nCLIP head ends in BatchNorm without
            affine (Sec. 3.2), so on its outputs μ ≈ 0 and v ≈ 1 and γ is what makes this row
            differ from plain sharpening by τ_s.
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
        if center is None or len(center) != 3:
            raise ValueError("uniform='centering' needs center=(running_mean, running_var, scale)")
        mean, var, scale = center
        if any(t.shape != logits.shape[1:] for t in center):
            raise ValueError(
                f"center statistics {tuple(mean.shape)}/{tuple(var.shape)}/{tuple(scale.shape)} "
                f"do not match K={logits.shape[1]}"
            )
        z = scale * (z - mean.detach()) * torch.rsqrt(var.detach() + center_eps)  # [B, K]
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
    image_center: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    text_center: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
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
            :func:`unified_target_log_prob`; image_center / text_center: (mean [K], var [K],
            scale [K]) of each modality for ``uniform='centering'``: the running statistics of its
            logits and its scale parameters (App. A).
        global_batch: batch statistics (p̄, Sinkhorn and batch-softmax sums) over all ranks.

    With p = uniform(softmax(f/τ_s)) (targets) and q = softmax(f/τ) (predictions):
        L_CE = −(p_I·log q_T + p_T·log q_I), L_EH = −(p_I·log p_I + p_T·log p_T) (batch means),
        L_HE = −(p̄_I·log p̄_I + p̄_T·log p̄_T), loss = (L_CE + λ1·L_EH − λ2·L_HE) / 2,
    returned as the modality means ``ce``, ``eh``, ``he`` (so ``loss`` = ce + λ1·eh − λ2·he, as in
    :func:`nclip_terms`), ``kl`` = ce − eh (detached), and the detached diagnostics of
    :func:`distribution_diagnostics` computed on the targets p (the ``logit_*`` stds on f_I). The
    CE is cross-modal, as in the main text's transcription of the algorithm (p_I·log q_T +
    p_T·log q_I); the appendix copy prints p_I·log q_I, which would not couple the modalities at all. With τ_s = τ and
    uniform='none' this is exactly :func:`nclip_terms`.
    """
    check_pair(image_logits, text_logits, "image_logits", "text_logits")
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
    eh, he = entropy_terms(log_p_i, p_i, log_p_t, p_t, global_batch=global_batch)
    loss = ce + lambda1 * eh - lambda2 * he
    diag = distribution_diagnostics(log_p_i, log_p_t, global_batch=global_batch,
                                    raw_logits=image_logits)  # P of the targets, logit stds of f_I
    return {"loss": loss, "ce": ce, "eh": eh, "he": he, "kl": (ce - eh).detach(), **diag}


