"""Protocol 3: zero-shot multi-label classification (xCLIP Tab. 3, after Huynh & Elhamifar 2020).

Every image is scored against every class prompt ensemble exactly as in zero-shot classification;
the scores are ranked per class (mAP over the classes that occur) and per image (micro F1 of the
top-k classes, at every k of ``nclip eval --topk``: by default the paper's 3, 5 (NUS-WIDE) and 10,
20 (OpenImages); a k above the number of classes is left out). On synthetic scenes the targets are
the set of shapes (and of colours) present; on the user's data, a ``multilabel:FILE.csv``
(:mod:`nclip.eval.multilabel_file`).
"""

from __future__ import annotations

import torch

from nclip.eval.metrics import mean_average_precision, precision_recall_f1_at_k
from nclip.eval.settings import MULTILABEL_TOPK

KS = MULTILABEL_TOPK


def evaluate(class_scores: torch.Tensor, targets: torch.Tensor, ks=KS) -> dict[str, float]:
    """{"mAP", "f1@k", "precision@k", "recall@k"} for scores [N, C] and bool targets [N, C]."""
    out = {"mAP": mean_average_precision(class_scores, targets)}
    for k in ks:
        if k > class_scores.shape[1]:
            continue
        prf = precision_recall_f1_at_k(class_scores, targets, k)
        out[f"f1@{k}"] = prf["f1"]
        out[f"precision@{k}"] = prf["precision"]
        out[f"recall@{k}"] = prf["recall"]
    return out
