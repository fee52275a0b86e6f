"""Text similarity: Spearman rank correlation (the STS-benchmark metric)."""

from __future__ import annotations

import torch

from nclip.eval.metrics._common import as_float


def _average_ranks(v: torch.Tensor) -> torch.Tensor:
    """1-based ranks with ties given the mean of their ranks (scipy.stats.rankdata 'average')."""
    n = v.numel()
    order = v.argsort(stable=True)
    sv = v[order]
    new_group = torch.ones(n, dtype=torch.bool)
    new_group[1:] = sv[1:] != sv[:-1]
    gid = new_group.cumsum(0) - 1  # group id of each sorted position
    starts = torch.nonzero(new_group).flatten()
    ends = torch.cat([starts[1:], torch.tensor([n])])  # exclusive
    avg = (starts + ends + 1).double() / 2.0  # mean of 1-based ranks starts+1 .. ends
    ranks = torch.empty(n, dtype=torch.float64)
    ranks[order] = avg[gid]
    return ranks


def spearman(x, y) -> float:
    """Spearman rank correlation (the STS-benchmark metric), equal to ``scipy.stats.spearmanr``.

    Pearson correlation of the average-tied ranks of ``x`` and ``y``. Returns NaN when either input
    is constant (as scipy does).

    Args:
        x, y: 1-D tensors of the same length >= 2 (e.g. predicted cosine and gold similarity).
    """
    a = as_float(x, "x", ndim=1)
    b = as_float(y, "y", ndim=1)
    if a.shape != b.shape:
        raise ValueError(f"x has {a.numel()} entries but y has {b.numel()}")
    if a.numel() < 2:
        raise ValueError(f"spearman needs at least 2 pairs, got {a.numel()}")
    ra, rb = _average_ranks(a), _average_ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = (ra.pow(2).sum() * rb.pow(2).sum()).sqrt()
    if float(denom) == 0.0:
        return float("nan")
    return float((ra * rb).sum() / denom)
