"""Multi-label metrics (xCLIP Tab. 3: NUS-WIDE / OpenImages zero-shot multi-label): mAP and
micro-averaged precision / recall / F1 at k."""

from __future__ import annotations

import torch

from nclip.eval.metrics._common import as_float, positive_int


def _multilabel_inputs(scores, targets) -> tuple[torch.Tensor, torch.Tensor]:
    s = as_float(scores, "scores", ndim=2)
    t = torch.as_tensor(targets)
    if t.shape != s.shape:
        raise ValueError(f"targets has shape {tuple(t.shape)} but scores has shape {tuple(s.shape)}")
    if t.dtype != torch.bool:
        if t.numel() and not bool(((t == 0) | (t == 1)).all()):
            raise ValueError("targets must be boolean or 0/1")
        t = t != 0
    return s, t


def mean_average_precision(scores, targets) -> float:
    """Mean over classes of average precision (the mAP of xCLIP Tab. 3).

    Per class, AP = sum_n (R_n - R_{n-1}) P_n over the distinct score thresholds in decreasing
    order (samples with tied scores enter together), exactly ``sklearn.metrics.
    average_precision_score(targets[:, c], scores[:, c])``. The mean runs over the classes with at
    least one positive (AP is undefined otherwise). Vectorised over classes: one sort of [N, C].

    Args:
        scores: [N, C] per-class scores. targets: bool (or 0/1) [N, C] ground-truth labels.
    """
    s, t = _multilabel_inputs(scores, targets)
    n, _ = s.shape
    npos = t.sum(dim=0)  # [C]
    valid = npos > 0
    if not bool(valid.any()):
        raise ValueError("targets has no positive in any class: mAP is undefined")
    s, t = s[:, valid], t[:, valid]
    order = s.argsort(dim=0, descending=True, stable=True)
    ss = s.gather(0, order)  # [N, C'] scores, decreasing down each column
    ts = t.gather(0, order).double()
    tp = ts.cumsum(dim=0)  # true positives among the top i+1
    # Each row's tie group ends at the last row with the same score; precision is measured there.
    is_end = torch.ones_like(ss, dtype=torch.bool)
    is_end[:-1] = ss[:-1] != ss[1:]
    idx = torch.arange(n).unsqueeze(1).expand_as(ss)
    end = torch.where(is_end, idx, torch.full_like(idx, n)).flip(0).cummin(dim=0).values.flip(0)
    precision_at_end = tp.gather(0, end) / (end + 1).double()
    ap = (ts * precision_at_end).sum(dim=0) / npos[valid].double()
    return ap.mean().item()


def precision_recall_f1_at_k(scores, targets, k: int) -> dict:
    """Micro-averaged precision / recall / F1 of top-k multi-label predictions (xCLIP Tab. 3).

    Definition (the "overall" F1 of the zero-shot multi-label protocol of Huynh & Elhamifar 2020,
    which xCLIP follows): every sample predicts its ``k`` highest-scoring classes; over all samples

        TP = #(predicted and positive),  precision = TP / (N * k),
        recall = TP / #positives,        F1 = 2 * precision * recall / (precision + recall)

    (F1 = 0 when TP = 0). Samples without positives still count in the precision denominator.
    Ties at the k-th score are broken by ``torch.topk``.

    Args:
        scores: [N, C]; targets: bool (or 0/1) [N, C]; k: 1 <= k <= C.

    Returns:
        ``{"precision": ..., "recall": ..., "f1": ...}``.
    """
    s, t = _multilabel_inputs(scores, targets)
    k = positive_int(k, "k")
    n, c = s.shape
    if n == 0:
        raise ValueError("scores is empty")
    if k > c:
        raise ValueError(f"k={k} exceeds the number of classes {c}")
    npos = int(t.sum())
    if npos == 0:
        raise ValueError("targets has no positive: recall is undefined")
    top = s.topk(k, dim=1).indices  # [N, k]
    tp = int(t.gather(1, top).sum())
    precision = tp / (n * k)
    recall = tp / npos
    f1 = 0.0 if tp == 0 else 2 * precision * recall / (precision + recall)
    return {"precision": precision, "recall": recall, "f1": f1}


def f1_at_k(scores, targets, k: int) -> float:
    """Micro-averaged F1@k of top-k multi-label predictions; see :func:`precision_recall_f1_at_k`."""
    return precision_recall_f1_at_k(scores, targets, k)["f1"]
