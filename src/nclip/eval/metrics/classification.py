"""Classification: top-k accuracy, confusion matrix, mean per-class recall and the prompt-ensembled
zero-shot classifier (CLIP Sec. 3.1.4, xCLIP appendix "zero-shot classification")."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from nclip.eval.metrics._common import as_float, as_labels, cutoffs, nonempty_matrix, positive_int, rank_of_target


def topk_accuracy(logits, labels, ks: Sequence[int] = (1, 5)) -> dict:
    """Top-k accuracy: the fraction of rows whose true class ranks among the ``k`` best scores.

    Args:
        logits: [N, C] class scores (logits, probabilities or cosine similarities).
        labels: int [N] true classes in [0, C).
        ks: cut-offs; ``k > C`` is clipped to ``C``.

    Returns:
        ``{"top{k}": accuracy in [0, 1]}``. Ties count against the true class (module docstring).
    """
    lg = nonempty_matrix(logits, "logits")
    n, c = lg.shape
    y = as_labels(labels, "labels", n=n, num_classes=c)
    ks = cutoffs(ks)
    rank = rank_of_target(lg, lg.gather(1, y[:, None])[:, 0])
    return {f"top{k}": (rank < min(k, c)).double().mean().item() for k in ks}


def confusion_matrix(pred, labels, num_classes: int) -> torch.Tensor:
    """Confusion matrix, int64 [num_classes, num_classes]: rows are true classes, columns predictions.

    Same layout as ``sklearn.metrics.confusion_matrix(labels, pred, labels=range(num_classes))``.

    Args:
        pred: int [N] predicted classes; labels: int [N] true classes; both in [0, num_classes).
    """
    num_classes = positive_int(num_classes, "num_classes")
    y = as_labels(labels, "labels", num_classes=num_classes)
    p = as_labels(pred, "pred", n=y.numel(), num_classes=num_classes)
    return torch.bincount(y * num_classes + p, minlength=num_classes**2).view(num_classes, num_classes)


def mean_per_class_recall(pred, labels, num_classes: int) -> float:
    """Mean per-class recall ("mean per-class accuracy", CLIP's metric for Pets, Flowers, Caltech...).

    Recall of class c = (#rows of class c predicted c) / (#rows of class c), averaged over the
    classes that occur in ``labels`` (absent classes have no defined recall and are skipped; this
    equals ``sklearn.metrics.balanced_accuracy_score``).

    Args:
        pred: int [N]; labels: int [N]; values in [0, num_classes).
    """
    cm = confusion_matrix(pred, labels, num_classes)
    support = cm.sum(dim=1)
    present = support > 0
    if not bool(present.any()):
        raise ValueError("labels is empty: mean per-class recall is undefined")
    recall = cm.diagonal()[present].double() / support[present].double()
    return recall.mean().item()


def zero_shot_classifier(class_text_embeddings) -> torch.Tensor:
    """Prompt-ensembled zero-shot classifier weights (CLIP Sec. 3.1.4; xCLIP appendix).

    For each class, every prompt's text embedding is L2-normalised, the normalised embeddings are
    averaged, and the mean is L2-normalised again ("the final text embedding is ensembled by
    averaging all text embeddings with different prompts"). Logits are then
    ``normalize(image_features) @ weights.T``.

    Args:
        class_text_embeddings: either a list of C tensors ``[n_prompts_c, d]`` (the number of prompts
            may differ per class) or a tensor ``[C, P, d]``.

    Returns:
        [C, d] unit-norm class weights.
    """
    if isinstance(class_text_embeddings, torch.Tensor):
        t = as_float(class_text_embeddings, "class_text_embeddings")
        if t.dim() != 3 or t.shape[0] == 0 or t.shape[1] == 0:
            raise ValueError(
                f"class_text_embeddings tensor must be [C, P, d] with C, P >= 1, got shape {tuple(t.shape)}"
            )
        return F.normalize(F.normalize(t, dim=-1).mean(dim=1), dim=-1)
    embs = list(class_text_embeddings)
    if not embs:
        raise ValueError("class_text_embeddings is empty: need at least one class")
    out = []
    d = None
    for c, e in enumerate(embs):
        e = as_float(e, f"class_text_embeddings[{c}]")
        if e.dim() == 1:
            e = e[None]
        if e.dim() != 2 or e.shape[0] == 0:
            raise ValueError(f"class_text_embeddings[{c}] must be [n_prompts >= 1, d], got shape {tuple(e.shape)}")
        if d is None:
            d = e.shape[1]
        elif e.shape[1] != d:
            raise ValueError(f"class_text_embeddings[{c}] has dimension {e.shape[1]}, class 0 has {d}")
        out.append(F.normalize(e, dim=-1).mean(dim=0))
    dtype = torch.float64 if any(o.dtype == torch.float64 for o in out) else torch.float32
    return F.normalize(torch.stack([o.to(dtype) for o in out]), dim=-1)
