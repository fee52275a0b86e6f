"""The CLIP linear probe: L-BFGS multinomial logistic regression on frozen features, its L2 strength
chosen on a seeded stratified validation split."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from nclip.eval.metrics._common import as_float, as_labels, positive_int
from nclip.eval.metrics.classification import mean_per_class_recall


def stratified_split(labels, val_fraction: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded stratified split of row indices into (train_idx, val_idx).

    Each class sends ``round(val_fraction * n_c)`` of its rows to validation, but always keeps at
    least one row in train (a class with a single row stays entirely in train). Indices are
    returned sorted.
    """
    y = as_labels(labels, "labels")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie in [0, 1), got {val_fraction!r}")
    g = torch.Generator().manual_seed(int(seed))
    train_idx, val_idx = [], []
    for c in torch.unique(y).tolist():
        idx = torch.nonzero(y == c).flatten()
        idx = idx[torch.randperm(idx.numel(), generator=g)]
        n_val = min(int(round(val_fraction * idx.numel())), idx.numel() - 1)
        val_idx.append(idx[:n_val])
        train_idx.append(idx[n_val:])
    if not train_idx:
        empty = torch.empty(0, dtype=torch.long)
        return empty, empty
    return torch.cat(train_idx).sort().values, torch.cat(val_idx).sort().values


def _fit_logreg(
    x: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
    l2: float,
    max_iter: int,
    init: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multinomial logistic regression, full-batch L-BFGS with strong-Wolfe line search.

    Minimises mean_i CE(x_i W + b, y_i) + (l2 / 2) ||W||_F^2 (the bias is not penalised).
    """
    d = x.shape[1]
    if init is None:
        w = torch.zeros(d, num_classes, dtype=x.dtype, requires_grad=True)
        b = torch.zeros(num_classes, dtype=x.dtype, requires_grad=True)
    else:
        w = init[0].clone().requires_grad_(True)
        b = init[1].clone().requires_grad_(True)
    opt = torch.optim.LBFGS(
        [w, b],
        lr=1.0,
        max_iter=max_iter,
        max_eval=max_iter * 2,
        history_size=20,
        tolerance_grad=1e-6 if x.dtype == torch.float32 else 1e-9,
        tolerance_change=1e-10 if x.dtype == torch.float32 else 1e-14,
        line_search_fn="strong_wolfe",
    )

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(torch.addmm(b, x, w), y) + 0.5 * l2 * w.pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return w.detach(), b.detach()


def linear_probe(
    train_x,
    train_y,
    test_x,
    test_y,
    num_classes: int,
    l2_grid: Sequence[float] = (1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 1e-5, 1e-6),
    val_fraction: float = 0.2,
    seed: int = 0,
    max_iter: int = 1000,
) -> dict:
    """Linear probe on frozen features (CLIP Sec. 3.2 / App. A.3 protocol, in torch).

    Multinomial logistic regression trained by full-batch L-BFGS (``torch.optim.LBFGS`` with
    ``line_search_fn="strong_wolfe"``), minimising

        mean_i CE(x_i W + b, y_i) + (l2 / 2) * ||W||_F^2        (bias unpenalised)

    which is scikit-learn's ``LogisticRegression(C=1 / (l2 * n_fit))`` objective divided by
    ``C * n_fit``, so the two have the same minimiser.

    Protocol:
      1. Features are standardised (zero mean, unit variance per dimension; constant dimensions
         are left unscaled) with the statistics of ``train_x`` -- the whole training set, labels
         unused, so no test information leaks.
      2. A validation split of ``val_fraction`` of the train rows is carved out, stratified by class
         and seeded (:func:`stratified_split`). Each L2 strength in ``l2_grid`` is fitted on the
         rest and scored by validation top-1 accuracy. The grid is walked from the strongest to the
         weakest penalty, each fit warm-started from the previous solution (the regularisation
         path), which makes the sweep cost little more than one fit. Ties in validation accuracy
         go to the stronger penalty.
      3. The chosen strength is refitted on train + validation and evaluated on the test set.

    With a single-value ``l2_grid`` the selection step is skipped (and ``val_fraction`` ignored).

    Computation runs in the features' dtype (float32 or float64).

    Args:
        train_x: [N_train, d]; train_y: int [N_train]; test_x: [N_test, d]; test_y: int [N_test];
            labels in [0, num_classes).
        l2_grid: candidate L2 strengths (>= 0).
        val_fraction: fraction of each class held out for selecting the L2 strength.
        seed: seeds the validation split (the fits themselves are deterministic).
        max_iter: L-BFGS iterations per fit.

    Returns:
        ``{"top1": float, "mean_per_class": float, "l2": chosen strength,
        "val_top1": {l2: validation accuracy}}`` (``val_top1`` is empty when there was no selection).
    """
    # (the length above is the protocol's docstring; the body is the three steps)
    num_classes = positive_int(num_classes, "num_classes")
    max_iter = positive_int(max_iter, "max_iter")
    xtr, ytr, xte, yte = _probe_inputs(train_x, train_y, test_x, test_y, num_classes)
    grid = _l2_path(l2_grid)
    xtr, xte = _standardise(xtr, xte)
    if len(grid) == 1:
        chosen, init, val_scores = grid[0], None, {}
    else:
        chosen, init, val_scores = _select_l2(xtr, ytr, num_classes, grid, val_fraction, seed, max_iter)
    w, b = _fit_logreg(xtr, ytr, num_classes, chosen, max_iter, init)
    pred = torch.addmm(b, xte, w).argmax(dim=1)
    return {
        "top1": (pred == yte).double().mean().item(),
        "mean_per_class": mean_per_class_recall(pred, yte, num_classes),
        "l2": chosen,
        "val_top1": val_scores,
    }


def _probe_inputs(train_x, train_y, test_x, test_y, num_classes: int):
    """The probe's features (float, same width) and labels (int64 in [0, num_classes)), checked."""
    xtr = as_float(train_x, "train_x", ndim=2)
    xte = as_float(test_x, "test_x", ndim=2)
    if xtr.shape[0] == 0 or xte.shape[0] == 0:
        raise ValueError(f"train_x and test_x must be non-empty, got {xtr.shape[0]} and {xte.shape[0]} rows")
    if xte.shape[1] != xtr.shape[1]:
        raise ValueError(f"test_x has dimension {xte.shape[1]} but train_x has {xtr.shape[1]}")
    ytr = as_labels(train_y, "train_y", n=xtr.shape[0], num_classes=num_classes)
    yte = as_labels(test_y, "test_y", n=xte.shape[0], num_classes=num_classes)
    return xtr, ytr, xte, yte


def _l2_path(l2_grid: Sequence[float]) -> list[float]:
    """The distinct L2 strengths of ``l2_grid``, strongest penalty first: the warm-start path."""
    grid = [float(v) for v in l2_grid]
    if not grid or any(not (v >= 0 and math.isfinite(v)) for v in grid):
        raise ValueError(f"l2_grid must be a non-empty sequence of finite values >= 0, got {l2_grid!r}")
    return sorted(set(grid), reverse=True)


def _standardise(xtr: torch.Tensor, xte: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1: both in a common dtype, scaled by the train rows' per-dimension mean and std
    (constant dimensions left unscaled)."""
    dtype = torch.promote_types(xtr.dtype, xte.dtype)
    xtr, xte = xtr.to(dtype), xte.to(dtype)
    mean = xtr.mean(dim=0)
    std = xtr.std(dim=0, correction=0)
    std = torch.where(std > 0, std, torch.ones_like(std))
    return (xtr - mean) / std, (xte - mean) / std


def _select_l2(x: torch.Tensor, y: torch.Tensor, num_classes: int, grid: list[float], val_fraction: float,
               seed: int, max_iter: int) -> tuple[float, tuple[torch.Tensor, torch.Tensor] | None, dict[float, float]]:
    """Step 2: every strength of ``grid`` (strongest first, each fit warm-started from the last)
    fitted on a stratified train part of (x, y) and scored by top-1 on the validation part.

    Returns the chosen strength (ties go to the stronger penalty), its fit (the warm start of the
    refit on all rows) and the validation accuracy of every strength.
    """
    tr_idx, va_idx = stratified_split(y, val_fraction, seed)
    if va_idx.numel() == 0:
        raise ValueError(
            f"val_fraction={val_fraction} leaves no validation rows for {x.shape[0]} train rows; "
            "raise it, add data, or pass a single-value l2_grid"
        )
    xa, ya, xv, yv = x[tr_idx], y[tr_idx], x[va_idx], y[va_idx]
    val_scores: dict[float, float] = {}
    best, chosen, chosen_init, init = -1.0, grid[0], None, None
    for l2 in grid:
        init = _fit_logreg(xa, ya, num_classes, l2, max_iter, init)
        acc = (torch.addmm(init[1], xv, init[0]).argmax(1) == yv).double().mean().item()
        val_scores[l2] = acc
        if acc > best:  # strict: ties keep the stronger penalty
            best, chosen, chosen_init = acc, l2, init
    return chosen, chosen_init, val_scores
