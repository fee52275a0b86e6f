"""Input checks shared by the metric families, and the pessimistic rank behind every ranking metric."""

from __future__ import annotations

import torch


def as_float(x, name: str, ndim: int | None = None) -> torch.Tensor:
    """``x`` as a floating tensor (float32 unless already float64), checked for rank and NaN."""
    t = torch.as_tensor(x)
    if not t.is_floating_point():
        t = t.to(torch.float32)
    elif t.dtype not in (torch.float32, torch.float64):
        t = t.to(torch.float32)  # half / bfloat16: metrics are computed in float32
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if torch.isnan(t).any():
        raise ValueError(f"{name} contains NaN")
    return t


def nonempty_matrix(x, name: str) -> torch.Tensor:
    """``x`` as :func:`as_float` makes it, 2-D with at least one row and one column: every score
    matrix, feature matrix and distribution a metric reads."""
    t = as_float(x, name, ndim=2)
    if t.shape[0] == 0 or t.shape[1] == 0:
        raise ValueError(f"{name} must be non-empty, got shape {tuple(t.shape)}")
    return t


def as_labels(x, name: str, n: int | None = None, num_classes: int | None = None) -> torch.Tensor:
    """``x`` as a 1-D int64 tensor, optionally of length ``n`` with values in [0, num_classes)."""
    t = torch.as_tensor(x)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got dtype {t.dtype}")
    t = t.long()
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if n is not None and t.numel() != n:
        raise ValueError(f"{name} has {t.numel()} entries, expected {n}")
    if num_classes is not None and t.numel() > 0:
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= num_classes:
            raise ValueError(f"{name} values must lie in [0, {num_classes}), got range [{lo}, {hi}]")
    return t


def positive_int(v, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v


def cutoffs(ks, name: str = "ks") -> tuple[int, ...]:
    if isinstance(ks, int):
        ks = (ks,)
    ks = tuple(ks)
    if not ks:
        raise ValueError(f"{name} must not be empty")
    for k in ks:
        positive_int(k, f"each of {name}")
    return ks


def rank_of_target(scores: torch.Tensor, target_scores: torch.Tensor) -> torch.Tensor:
    """Pessimistic 0-based rank of a target among the candidates in each row.

    ``scores`` [R, M]; ``target_scores`` [R] (the target's own score, which is one of the row's
    entries). rank = #{candidates with score >= target} - 1, i.e. ties count against the target.
    """
    return (scores >= target_scores[:, None]).sum(dim=1) - 1
