"""Protocol 1: zero-shot classification with prompt ensembles (CLIP Sec. 3.1.4; xCLIP Sec. 4.1, App. C).

Every class is represented by the ensemble of its prompts (``LabelKind.templates`` filled with the
class name, see :func:`nclip.eval.features.class_text_outputs`), every image is scored against every
class with the selected score (:mod:`nclip.objectives.scores`; CLIP: cosine; nCLIP: −L_CE, Sec. 3.1,
symmetrised by default; yCLIP: its S, App. B.2 Eq. 2), and the top-scoring class is the prediction.
Reported: top-1, top-5 (when there are more than 5 classes), mean per-class recall and the chance
level 1 / C.
"""

from __future__ import annotations

import torch

from nclip.eval.features import similarity
from nclip.eval.metrics import confusion_matrix, mean_per_class_recall, topk_accuracy
from nclip.objectives.scores import Score


def scores(image: dict[str, torch.Tensor], classes: dict[str, torch.Tensor], score: Score) -> torch.Tensor:
    """[N, C] class scores of N images (head outputs) against C ensembled class outputs by ``score``
    (:func:`nclip.eval.features.similarity`)."""
    return similarity(image, classes, score)


def evaluate(class_scores: torch.Tensor, labels: torch.Tensor) -> tuple[dict[str, float], torch.Tensor]:
    """(metrics, predictions [N]) for ``class_scores`` [N, C] and true ``labels`` [N]."""
    n_cls = class_scores.shape[1]
    ks = (1, 5) if n_cls > 5 else (1,)
    out = dict(topk_accuracy(class_scores, labels, ks=ks))
    pred = class_scores.argmax(dim=1)
    out["mean_per_class"] = mean_per_class_recall(pred, labels, n_cls)
    out["chance"] = 1.0 / n_cls
    return out, pred


def confusion(pred: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """[C, C] counts, rows = true class, columns = prediction."""
    return confusion_matrix(pred, labels, num_classes)
