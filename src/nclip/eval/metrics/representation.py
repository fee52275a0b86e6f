"""Representation diagnostics: effective rank, alignment and uniformity (Wang & Isola 2020),
prototype usage and the row / column std of the assignment matrix (xCLIP appendix Fig. B1) --
the numbers that show a collapse."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from nclip.eval.metrics._common import as_float, nonempty_matrix, positive_int


def effective_rank(features, center: bool = False, rtol: float | None = None) -> float:
    """Effective rank (Roy & Vetterli 2007): exp of the Shannon entropy of the normalised spectrum.

    With singular values sigma_i of ``features`` and p_i = sigma_i / sum_j sigma_j,
    erank = exp(-sum_i p_i log p_i) (0 log 0 = 0). It lies in [1, rank]: exactly r for a rank-r
    matrix with r equal singular values, close to 1 for a collapsed (near rank-1) embedding. This is
    also RankMe (Garrido et al. 2023) for an embedding matrix.

    Args:
        features: [N, d]. center: subtract the column mean first (rank of the covariance rather than
            of the raw matrix).
        rtol: singular values below ``rtol * max`` are rounding noise and dropped; default
            ``max(N, d) * machine eps`` of the input dtype (the ``torch.linalg.matrix_rank`` rule),
            so a float32 rank-r matrix scores <= r, not r plus noise.

    Returns:
        float; 0.0 for an all-zero matrix (nothing left to measure).
    """
    x = nonempty_matrix(features, "features")
    if rtol is None:
        rtol = max(x.shape) * torch.finfo(x.dtype).eps
    x = x.double()
    if center:
        x = x - x.mean(dim=0, keepdim=True)
    sv = torch.linalg.svdvals(x)
    if float(sv.max()) == 0.0:
        return 0.0
    sv = sv[sv > rtol * sv.max()]
    p = sv / sv.sum()
    return math.exp(float(-(p * p.log()).sum()))


def alignment(x, y, alpha: float = 2.0) -> float:
    """Alignment loss of Wang & Isola 2020: E_i ||f(x_i) - f(y_i)||_2^alpha over positive pairs.

    ``x`` and ``y`` are L2-normalised here, so the value lies in [0, 2^alpha]: 0 when every pair
    coincides, 2^alpha when every pair is antipodal. Lower is better.

    Args:
        x, y: [N, d] paired embeddings (row i of ``x`` and row i of ``y`` are a positive pair).
        alpha: exponent > 0.
    """
    a = as_float(x, "x", ndim=2)
    b = as_float(y, "y", ndim=2)
    if a.shape != b.shape:
        raise ValueError(f"x has shape {tuple(a.shape)} but y has shape {tuple(b.shape)}")
    if a.shape[0] == 0:
        raise ValueError("x and y are empty")
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha!r}")
    dtype = torch.promote_types(a.dtype, b.dtype)
    a, b = F.normalize(a.to(dtype), dim=1), F.normalize(b.to(dtype), dim=1)
    return (a - b).norm(dim=1).pow(alpha).mean().item()


def uniformity(x, t: float = 2.0, chunk_size: int = 2048) -> float:
    """Uniformity loss of Wang & Isola 2020: log E_{i<j} exp(-t ||f(x_i) - f(x_j)||_2^2).

    Over all distinct pairs (as ``torch.pdist`` in the paper's code) of L2-normalised rows. It is 0
    for a fully collapsed embedding (all rows equal) and more negative the more uniformly the rows
    cover the sphere; two antipodal points give -4t. Computed blockwise with a running logsumexp, so
    memory is O(chunk_size x N) instead of O(N^2).

    Args:
        x: [N, d] with N >= 2. t: temperature > 0.
    """
    a = as_float(x, "x", ndim=2)
    n = a.shape[0]
    if n < 2:
        raise ValueError(f"x needs at least 2 rows for pairwise distances, got {n}")
    if not t > 0:
        raise ValueError(f"t must be > 0, got {t!r}")
    chunk_size = positive_int(chunk_size, "chunk_size")
    a = F.normalize(a, dim=1)
    parts = []
    cols = torch.arange(n)
    for s in range(0, n, chunk_size):
        blk = a[s : s + chunk_size]
        sq = (2.0 - 2.0 * blk @ a.T).clamp_min(0.0)  # [b, N] squared distances on the sphere
        rows = torch.arange(s, s + blk.shape[0])
        upper = cols[None, :] > rows[:, None]  # pairs i < j only
        if upper.any():
            parts.append(torch.logsumexp((-t * sq)[upper], dim=0))
    total = torch.logsumexp(torch.stack(parts), dim=0)
    return (total - math.log(n * (n - 1) / 2)).item()


def prototype_usage(probs) -> dict:
    """How many prototypes (clusters) the assignments actually use -- a collapse diagnostic.

    Each row's argmax is its hard assignment. With the histogram h_k of assignments (normalised to
    q_k = h_k / N):

    * ``used_fraction``: fraction of the K prototypes chosen by at least one row;
    * ``num_used``: their number;
    * ``entropy``: -sum_k q_k log q_k in nats (0 = every row on one prototype, log K = uniform);
    * ``perplexity``: exp(entropy), the "effective number" of prototypes in use.

    Args:
        probs: [N, K] assignment probabilities (logits work too: only the argmax is used).
    """
    p = nonempty_matrix(probs, "probs")
    n, k = p.shape
    counts = torch.bincount(p.argmax(dim=1), minlength=k)
    q = counts[counts > 0].double() / n
    entropy = float(-(q * q.log()).sum())
    num_used = int((counts > 0).sum())
    return {
        "used_fraction": num_used / k,
        "num_used": num_used,
        "entropy": entropy,
        "perplexity": math.exp(entropy),
    }


def probability_std(probs) -> dict:
    """Row and column standard deviation of the assignment matrix (xCLIP appendix, Fig. B1).

    With P^T in R^{B x K} (one row per sample), ``row_std`` is the std over the K entries of each
    row, averaged over rows (0 when every sample's distribution is uniform -- the collapse of
    Fig. B1 gray), and ``col_std`` is the std over the B samples of each column, averaged over
    columns (0 when every sample has the same distribution). Population std (divide by the count,
    not count - 1), so a single row gives col_std 0 rather than NaN.

    Note: the paper says the column std "converges to 1 ... due to Batch Normalization", which
    suggests its curves were computed on the BN-normalised logits before the softmax; pass those
    to reproduce Fig. B1, or the probabilities for the literal row/column std of P.

    Args:
        probs: [N, K].

    Returns:
        ``{"row_std": float, "col_std": float}``.
    """
    p = nonempty_matrix(probs, "probs")
    return {
        "row_std": p.std(dim=1, correction=0).mean().item(),
        "col_std": p.std(dim=0, correction=0).mean().item(),
    }
