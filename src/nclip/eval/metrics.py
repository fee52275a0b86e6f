"""Pure evaluation metrics: tensors in, Python numbers / dicts / tensors out.

Nothing here knows about models, datasets or the trainer. Every function validates its inputs and
raises :class:`ValueError` naming the argument and the mismatch. Inputs may be float32 or float64
tensors (anything :func:`torch.as_tensor` accepts is converted); integer label tensors of any integer
dtype are accepted and used as ``int64``.

Sections (and the protocol each follows):

* retrieval -- :func:`recall_at_k` (CLIP / xCLIP Tab. 2 zero-shot image-text retrieval).
* classification -- :func:`topk_accuracy`, :func:`confusion_matrix`, :func:`mean_per_class_recall`,
  :func:`zero_shot_classifier` (CLIP prompt ensemble, xCLIP appendix "zero-shot classification"),
  :func:`knn_predict` (InstDisc / DINO weighted k-NN), :func:`linear_probe` (CLIP linear probe:
  L-BFGS multinomial logistic regression with a validated L2 strength).
* multi-label (xCLIP Tab. 3) -- :func:`mean_average_precision`, :func:`precision_recall_f1_at_k`,
  :func:`f1_at_k`.
* clustering (ProtoCLIP Tab. A.12c) -- :func:`cluster_scores`.
* representation diagnostics -- :func:`effective_rank`, :func:`alignment`, :func:`uniformity`,
  :func:`prototype_usage`, :func:`probability_std` (xCLIP appendix Fig. B1).
* text similarity -- :func:`spearman`.
* mask probing (xCLIP Sec. 4.2.1 / Tab. D3, after DINO) -- :func:`attention_mask_jaccard`.

Ranking convention. Where a metric ranks candidates (:func:`recall_at_k`, :func:`topk_accuracy`),
ties are counted *against* the query: a wrong candidate that scores exactly as high as the right one
is ranked ahead of it. This makes the metrics deterministic (no dependence on ``torch.topk``'s tie
order) and stops a collapsed model that gives every candidate the same score from reporting
perfect recall -- exactly the failure mode the non-contrastive objectives must be watched for.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "recall_at_k",
    "topk_accuracy",
    "confusion_matrix",
    "mean_per_class_recall",
    "zero_shot_classifier",
    "knn_predict",
    "linear_probe",
    "stratified_split",
    "mean_average_precision",
    "precision_recall_f1_at_k",
    "f1_at_k",
    "cluster_scores",
    "effective_rank",
    "alignment",
    "uniformity",
    "prototype_usage",
    "probability_std",
    "spearman",
    "attention_mask_jaccard",
]


# --------------------------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------------------------


def _float(x, name: str, ndim: int | None = None) -> torch.Tensor:
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


def _labels(x, name: str, n: int | None = None, num_classes: int | None = None) -> torch.Tensor:
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


def _positive_int(v, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v


def _ks(ks, name: str = "ks") -> tuple[int, ...]:
    if isinstance(ks, int):
        ks = (ks,)
    ks = tuple(ks)
    if not ks:
        raise ValueError(f"{name} must not be empty")
    for k in ks:
        _positive_int(k, f"each of {name}")
    return ks


def _rank_of_target(scores: torch.Tensor, target_scores: torch.Tensor) -> torch.Tensor:
    """Pessimistic 0-based rank of a target among the candidates in each row.

    ``scores`` [R, M]; ``target_scores`` [R] (the target's own score, which is one of the row's
    entries). rank = #{candidates with score >= target} - 1, i.e. ties count against the target.
    """
    return (scores >= target_scores[:, None]).sum(dim=1) - 1


# --------------------------------------------------------------------------------------------
# retrieval
# --------------------------------------------------------------------------------------------


def recall_at_k(similarity, text_to_image, ks: Sequence[int] = (1, 5, 10)) -> dict:
    """Image-text retrieval recall@k with several captions per image (COCO / Flickr protocol).

    This is the zero-shot retrieval metric of CLIP and of xCLIP Tab. 2.

    Args:
        similarity: [n_images, n_texts] similarity (e.g. cosine) between every image and caption.
        text_to_image: int [n_texts]; ``text_to_image[j]`` is the index of caption ``j``'s image.
            An image may own any number of captions (COCO: 5, Flickr30k: 5).
        ks: the cut-offs. A ``k`` larger than the number of candidates in a direction is clipped
            to that number (so it scores 1.0); the key still uses the requested ``k``.

    Returns:
        ``{"i2t@k": ..., "t2i@k": ..., "mean_recall": ...}`` with values in [0, 1].

        * image -> text: image ``i`` is a hit at ``k`` when ANY of its captions ranks in its top
          ``k`` texts; averaged over images that own at least one caption (images without a
          caption are retrieval distractors for text -> image only).
        * text -> image: caption ``j`` is a hit when its image ranks in its top ``k`` images.
        * ``mean_recall``: the mean of all the ``i2t@k`` and ``t2i@k`` values above.

    Ties count against the query (see the module docstring): a constant similarity matrix scores
    0 for every ``k`` smaller than the candidate count.
    """
    sim = _float(similarity, "similarity", ndim=2)
    n_img, n_txt = sim.shape
    if n_img == 0 or n_txt == 0:
        raise ValueError(f"similarity must be non-empty, got shape {tuple(sim.shape)}")
    t2i = _labels(text_to_image, "text_to_image", n=n_txt, num_classes=n_img)
    ks = _ks(ks)

    cols = torch.arange(n_txt)
    pos = sim[t2i, cols]  # [n_txt] each caption's score with its own image

    # text -> image: rank of the caption's image in column j (chunked: [n_img, chunk] bools).
    t2i_rank = torch.empty(n_txt, dtype=torch.long)
    chunk = max(1, (1 << 24) // max(n_img, 1))
    for s in range(0, n_txt, chunk):
        e = min(s + chunk, n_txt)
        t2i_rank[s:e] = _rank_of_target(sim[:, s:e].T, pos[s:e])

    # image -> text: the best-ranked caption of image i is the one with the highest score, and its
    # pessimistic rank is #{texts with score >= that score} - 1 (it counts itself once).
    best = torch.full((n_img,), -math.inf, dtype=sim.dtype).scatter_reduce(
        0, t2i, pos, reduce="amax", include_self=True
    )
    has_caption = torch.bincount(t2i, minlength=n_img) > 0
    i2t_rank = torch.empty(n_img, dtype=torch.long)
    chunk = max(1, (1 << 24) // n_txt)
    for s in range(0, n_img, chunk):
        e = min(s + chunk, n_img)
        i2t_rank[s:e] = _rank_of_target(sim[s:e], best[s:e])
    i2t_rank = i2t_rank[has_caption]

    out: dict[str, float] = {}
    for k in ks:
        out[f"i2t@{k}"] = (i2t_rank < min(k, n_txt)).double().mean().item()
    for k in ks:
        out[f"t2i@{k}"] = (t2i_rank < min(k, n_img)).double().mean().item()
    out["mean_recall"] = sum(out.values()) / len(out)
    return out


# --------------------------------------------------------------------------------------------
# classification
# --------------------------------------------------------------------------------------------


def topk_accuracy(logits, labels, ks: Sequence[int] = (1, 5)) -> dict:
    """Top-k accuracy: the fraction of rows whose true class ranks among the ``k`` best scores.

    Args:
        logits: [N, C] class scores (logits, probabilities or cosine similarities).
        labels: int [N] true classes in [0, C).
        ks: cut-offs; ``k > C`` is clipped to ``C``.

    Returns:
        ``{"top{k}": accuracy in [0, 1]}``. Ties count against the true class (module docstring).
    """
    lg = _float(logits, "logits", ndim=2)
    n, c = lg.shape
    if n == 0 or c == 0:
        raise ValueError(f"logits must be non-empty, got shape {tuple(lg.shape)}")
    y = _labels(labels, "labels", n=n, num_classes=c)
    ks = _ks(ks)
    rank = _rank_of_target(lg, lg.gather(1, y[:, None])[:, 0])
    return {f"top{k}": (rank < min(k, c)).double().mean().item() for k in ks}


def confusion_matrix(pred, labels, num_classes: int) -> torch.Tensor:
    """Confusion matrix, int64 [num_classes, num_classes]: rows are true classes, columns predictions.

    Same layout as ``sklearn.metrics.confusion_matrix(labels, pred, labels=range(num_classes))``.

    Args:
        pred: int [N] predicted classes; labels: int [N] true classes; both in [0, num_classes).
    """
    num_classes = _positive_int(num_classes, "num_classes")
    y = _labels(labels, "labels", num_classes=num_classes)
    p = _labels(pred, "pred", n=y.numel(), num_classes=num_classes)
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
        t = _float(class_text_embeddings, "class_text_embeddings")
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
        e = _float(e, f"class_text_embeddings[{c}]")
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


def knn_predict(
    train_features,
    train_labels,
    test_features,
    num_classes: int,
    k: int = 20,
    temperature: float = 0.07,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """Weighted k-nearest-neighbour classification (InstDisc, Wu et al. 2018; DINO's ``eval_knn``).

    Features are L2-normalised here. For each test row, its ``k`` nearest train rows by cosine
    similarity vote for their label with weight ``exp(cos / temperature)``; the class with the
    largest summed weight wins (ties: the lowest class index). Test rows are processed in chunks of
    ``chunk_size`` so memory is O(chunk_size x n_train).

    Args:
        train_features: [N_train, d]; train_labels: int [N_train] in [0, num_classes).
        test_features: [N_test, d].
        k: neighbours, clipped to N_train. temperature: vote temperature T (> 0).

    Returns:
        int64 [N_test] predicted classes.
    """
    num_classes = _positive_int(num_classes, "num_classes")
    k = _positive_int(k, "k")
    chunk_size = _positive_int(chunk_size, "chunk_size")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    tr = _float(train_features, "train_features", ndim=2)
    te = _float(test_features, "test_features", ndim=2)
    if tr.shape[0] == 0:
        raise ValueError("train_features is empty")
    if te.shape[1] != tr.shape[1]:
        raise ValueError(
            f"test_features has dimension {te.shape[1]} but train_features has {tr.shape[1]}"
        )
    y = _labels(train_labels, "train_labels", n=tr.shape[0], num_classes=num_classes)
    dtype = torch.promote_types(tr.dtype, te.dtype)
    tr = F.normalize(tr.to(dtype), dim=1)
    te = F.normalize(te.to(dtype), dim=1)
    k = min(k, tr.shape[0])

    out = torch.empty(te.shape[0], dtype=torch.long)
    for s in range(0, te.shape[0], chunk_size):
        sim = te[s : s + chunk_size] @ tr.T  # [b, N_train]
        top_sim, top_idx = sim.topk(k, dim=1)  # [b, k]
        weights = (top_sim / temperature).exp()
        votes = torch.zeros(sim.shape[0], num_classes, dtype=dtype)
        votes.scatter_add_(1, y[top_idx], weights)  # [b, C]
        out[s : s + chunk_size] = votes.argmax(dim=1)
    return out


def stratified_split(labels, val_fraction: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded stratified split of row indices into (train_idx, val_idx).

    Each class sends ``round(val_fraction * n_c)`` of its rows to validation, but always keeps at
    least one row in train (a class with a single row stays entirely in train). Indices are
    returned sorted.
    """
    y = _labels(labels, "labels")
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
    num_classes = _positive_int(num_classes, "num_classes")
    max_iter = _positive_int(max_iter, "max_iter")
    xtr = _float(train_x, "train_x", ndim=2)
    xte = _float(test_x, "test_x", ndim=2)
    if xtr.shape[0] == 0 or xte.shape[0] == 0:
        raise ValueError(f"train_x and test_x must be non-empty, got {xtr.shape[0]} and {xte.shape[0]} rows")
    if xte.shape[1] != xtr.shape[1]:
        raise ValueError(f"test_x has dimension {xte.shape[1]} but train_x has {xtr.shape[1]}")
    ytr = _labels(train_y, "train_y", n=xtr.shape[0], num_classes=num_classes)
    yte = _labels(test_y, "test_y", n=xte.shape[0], num_classes=num_classes)
    grid = [float(v) for v in l2_grid]
    if not grid or any(not (v >= 0 and math.isfinite(v)) for v in grid):
        raise ValueError(f"l2_grid must be a non-empty sequence of finite values >= 0, got {l2_grid!r}")
    grid = sorted(set(grid), reverse=True)  # strongest penalty first: the warm-start path

    dtype = torch.promote_types(xtr.dtype, xte.dtype)
    xtr, xte = xtr.to(dtype), xte.to(dtype)
    mean = xtr.mean(dim=0)
    std = xtr.std(dim=0, correction=0)
    std = torch.where(std > 0, std, torch.ones_like(std))
    xtr = (xtr - mean) / std
    xte = (xte - mean) / std

    val_scores: dict[float, float] = {}
    init = None
    if len(grid) == 1:
        chosen = grid[0]
    else:
        tr_idx, va_idx = stratified_split(ytr, val_fraction, seed)
        if va_idx.numel() == 0:
            raise ValueError(
                f"val_fraction={val_fraction} leaves no validation rows for {xtr.shape[0]} train rows; "
                "raise it, add data, or pass a single-value l2_grid"
            )
        xa, ya, xv, yv = xtr[tr_idx], ytr[tr_idx], xtr[va_idx], ytr[va_idx]
        best = -1.0
        chosen = grid[0]
        chosen_init = None
        for l2 in grid:
            init = _fit_logreg(xa, ya, num_classes, l2, max_iter, init)
            acc = (torch.addmm(init[1], xv, init[0]).argmax(1) == yv).double().mean().item()
            val_scores[l2] = acc
            if acc > best:  # strict: ties keep the stronger penalty
                best, chosen, chosen_init = acc, l2, init
        init = chosen_init

    w, b = _fit_logreg(xtr, ytr, num_classes, chosen, max_iter, init)
    pred = torch.addmm(b, xte, w).argmax(dim=1)
    return {
        "top1": (pred == yte).double().mean().item(),
        "mean_per_class": mean_per_class_recall(pred, yte, num_classes),
        "l2": chosen,
        "val_top1": val_scores,
    }


# --------------------------------------------------------------------------------------------
# multi-label (xCLIP Tab. 3: NUS-WIDE / OpenImages zero-shot multi-label)
# --------------------------------------------------------------------------------------------


def _multilabel_inputs(scores, targets) -> tuple[torch.Tensor, torch.Tensor]:
    s = _float(scores, "scores", ndim=2)
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
    k = _positive_int(k, "k")
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


# --------------------------------------------------------------------------------------------
# clustering (ProtoCLIP App. E, Tab. A.12c)
# --------------------------------------------------------------------------------------------


def cluster_scores(
    features,
    labels,
    num_clusters: int | None = None,
    seed: int = 0,
    normalize: bool = True,
    n_init: int = 10,
) -> dict:
    """K-Means clustering quality against ground-truth classes (ProtoCLIP App. E, Tab. A.12c).

    The features are clustered by K-Means into ``num_clusters`` groups (default: the number of
    distinct classes in ``labels``, as in ProtoCLIP) and the cluster ids are compared with the
    classes by the Adjusted Rand Index and Adjusted Mutual Information (``sklearn.metrics``; AMI
    with the arithmetic-mean normaliser, sklearn's default). NMI is reported as well.

    Why scikit-learn's ``KMeans`` and not ``faiss.Kmeans``: this runs once per evaluation on a test
    split (10^3 - 10^5 rows, tens to hundreds of clusters), where sklearn is fast enough, and it
    gives k-means++ seeding with ``n_init`` restarts and results that depend only on ``seed``.
    faiss (random-sample seeding, thread-count dependent reductions) is the right tool for the
    training-time prototypes (ProtoCLIP's K = 20,000 per episode), not for a reported score.

    Args:
        features: [N, d]. labels: int [N] ground-truth classes (any non-negative ids).
        num_clusters: K; ``None`` = number of distinct labels. Must be <= N.
        seed: K-Means random state. normalize: L2-normalise features first (cosine geometry, how
            CLIP-style embeddings are compared). n_init: K-Means restarts.

    Returns:
        ``{"ari": float, "ami": float, "nmi": float, "num_clusters": int}``.
    """
    from sklearn.cluster import KMeans
    from sklearn.metrics import adjusted_mutual_info_score, adjusted_rand_score, normalized_mutual_info_score

    x = _float(features, "features", ndim=2)
    y = _labels(labels, "labels", n=x.shape[0])
    if x.shape[0] < 2:
        raise ValueError(f"features needs at least 2 rows, got {x.shape[0]}")
    if num_clusters is None:
        num_clusters = int(torch.unique(y).numel())
    num_clusters = _positive_int(num_clusters, "num_clusters")
    if num_clusters > x.shape[0]:
        raise ValueError(f"num_clusters={num_clusters} exceeds the number of rows {x.shape[0]}")
    if normalize:
        x = F.normalize(x, dim=1)
    km = KMeans(n_clusters=num_clusters, n_init=_positive_int(n_init, "n_init"), random_state=seed)
    pred = km.fit_predict(x.double().numpy())
    yn = y.numpy()
    return {
        "ari": float(adjusted_rand_score(yn, pred)),
        "ami": float(adjusted_mutual_info_score(yn, pred)),
        "nmi": float(normalized_mutual_info_score(yn, pred)),
        "num_clusters": num_clusters,
    }


# --------------------------------------------------------------------------------------------
# representation diagnostics
# --------------------------------------------------------------------------------------------


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
    x = _float(features, "features", ndim=2)
    if x.numel() == 0:
        raise ValueError(f"features must be non-empty, got shape {tuple(x.shape)}")
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
    a = _float(x, "x", ndim=2)
    b = _float(y, "y", ndim=2)
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
    a = _float(x, "x", ndim=2)
    n = a.shape[0]
    if n < 2:
        raise ValueError(f"x needs at least 2 rows for pairwise distances, got {n}")
    if not t > 0:
        raise ValueError(f"t must be > 0, got {t!r}")
    chunk_size = _positive_int(chunk_size, "chunk_size")
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


def _probs(probs, name: str = "probs") -> torch.Tensor:
    p = _float(probs, name, ndim=2)
    if p.shape[0] == 0 or p.shape[1] == 0:
        raise ValueError(f"{name} must be non-empty [N, K], got shape {tuple(p.shape)}")
    return p


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
    p = _probs(probs)
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
    p = _probs(probs)
    return {
        "row_std": p.std(dim=1, correction=0).mean().item(),
        "col_std": p.std(dim=0, correction=0).mean().item(),
    }


# --------------------------------------------------------------------------------------------
# text similarity
# --------------------------------------------------------------------------------------------


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
    a = _float(x, "x", ndim=1)
    b = _float(y, "y", ndim=1)
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


# --------------------------------------------------------------------------------------------
# mask probing (xCLIP Sec. 4.2.1 and Tab. D3, following DINO Sec. 4.2.1 / Tab. 7)
# --------------------------------------------------------------------------------------------


def _mass_threshold(a: torch.Tensor, threshold: float, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Keep the top values of each row that hold ``threshold`` of the row's mass (DINO's rule).

    ``a`` [R, M] non-negative. DINO sorts ascending, takes the normalised cumulative sum and keeps
    entries with cumsum > 1 - threshold; equivalently an entry is kept iff the mass strictly ranked
    above it is < threshold * total. Here ties are resolved by value (all entries equal to the
    last kept value are kept), so the result does not depend on sort order -- which matters after
    nearest upsampling, where every patch value appears many times. A row of zeros keeps nothing.

    ``weights`` [M] (optional, >= 0): entry m stands for ``weights[m]`` identical pixels (a patch
    and the pixels nearest upsampling copies it to). Thresholding the weighted patch map gives
    exactly the pixel-level result of thresholding the upsampled map, at patch-level cost.
    """
    sv, order = a.sort(dim=1, descending=True)
    mass = sv if weights is None else sv * weights[order]
    excl = mass.cumsum(dim=1) - mass  # mass ranked strictly above each sorted position
    total = mass.sum(dim=1, keepdim=True)
    n_keep = (excl < threshold * total).sum(dim=1)  # a prefix of the sorted row
    thr = sv.gather(1, (n_keep - 1).clamp_min(0)[:, None])
    return (a >= thr) & (n_keep[:, None] > 0) & (total > 0)


def attention_mask_jaccard(
    attn,
    masks,
    threshold: float = 0.6,
    mode: str = "nearest",
    ignore=None,
    chunk_size: int = 16,
) -> dict:
    """Mask probing: Jaccard of thresholded [CLS] attention maps with foreground masks.

    Protocol of xCLIP Sec. 4.2.1 / Tab. D3, which follows DINO (Caron et al. 2021, Sec. 4.2.1): for
    each head of the last layer, the attention of the [CLS] query over the patches is

    1. upsampled to the mask resolution (``mode="nearest"``, DINO's choice -- each patch becomes a
       block of pixels; or ``"bilinear"``, ``align_corners=False``, for smoother boundaries);
    2. thresholded the DINO way: keep the highest-attention pixels that together hold
       ``threshold`` (DINO: 0.6) of the upsampled map's attention mass (:func:`_mass_threshold`).
       With nearest upsampling this is computed exactly on the patch map, each patch weighted by
       the number of pixels it covers (for an integer scale factor: DINO's threshold-then-upsample);
    3. compared with the ground-truth foreground mask by Jaccard = |pred & gt| / |pred | gt|.

    Jaccard is averaged over samples per head; the best head is reported (the paper "retain[s] the
    attention mask with the highest similarity"). A sample whose prediction and mask are both empty
    scores 1.

    Args:
        attn: [N, heads, h, w] non-negative attention of [CLS] to the h x w patch grid.
        masks: bool (or 0/1) [N, H, W] foreground masks.
        threshold: attention-mass fraction in (0, 1].
        mode: ``"nearest"`` or ``"bilinear"``.
        ignore: optional bool [N, H, W]; True pixels (e.g. VOC's 255 "void" border) are excluded
            from both intersection and union.
        chunk_size: samples processed at a time. Nearest mode never materialises the upsampled maps
            (O(chunk x heads x h x w + chunk x H x W) memory); bilinear mode sorts every upsampled
            map, O(chunk x heads x H x W) memory and markedly slower.

    Returns:
        ``{"per_head": float64 tensor [heads], "per_sample": float64 tensor [N, heads],
        "best_head": int, "best": float}``.
    """
    a = _float(attn, "attn", ndim=4)
    m = torch.as_tensor(masks)
    if m.dim() != 3:
        raise ValueError(f"masks must be [N, H, W], got shape {tuple(m.shape)}")
    n, heads = a.shape[:2]
    if m.shape[0] != n:
        raise ValueError(f"masks has {m.shape[0]} samples but attn has {n}")
    if n == 0 or heads == 0 or a.shape[2] == 0 or a.shape[3] == 0 or m.shape[1] == 0 or m.shape[2] == 0:
        raise ValueError(f"attn {tuple(a.shape)} and masks {tuple(m.shape)} must be non-empty")
    if bool((a < 0).any()):
        raise ValueError("attn must be non-negative (softmax attention weights)")
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must lie in (0, 1], got {threshold!r}")
    if mode not in ("nearest", "bilinear"):
        raise ValueError(f"mode must be 'nearest' or 'bilinear', got {mode!r}")
    m = m != 0 if m.dtype != torch.bool else m
    if ignore is not None:
        ig = torch.as_tensor(ignore)
        if ig.shape != m.shape:
            raise ValueError(f"ignore has shape {tuple(ig.shape)} but masks has shape {tuple(m.shape)}")
        valid = ~(ig != 0 if ig.dtype != torch.bool else ig)
    else:
        valid = torch.ones_like(m)
    chunk_size = _positive_int(chunk_size, "chunk_size")
    hh, ww = m.shape[1:]

    h, w = a.shape[2:]
    if mode == "nearest":
        # source patch of every output pixel, exactly as F.interpolate(mode="nearest") picks it
        src = torch.arange(h * w, dtype=torch.float64).view(1, 1, h, w)
        src = F.interpolate(src, size=(hh, ww), mode="nearest").round().long().flatten()  # [H*W]
        cover = torch.bincount(src, minlength=h * w).to(a.dtype)  # pixels per patch

    per_sample = torch.empty(n, heads, dtype=torch.float64)
    for s in range(0, n, chunk_size):
        blk = a[s : s + chunk_size]  # [b, heads, h, w]
        b = blk.shape[0]
        v = valid[s : s + b].flatten(1)  # [b, H*W]
        gt = m[s : s + b].flatten(1) & v
        if mode == "nearest":
            keep = _mass_threshold(blk.reshape(b * heads, h * w), threshold, cover).view(b, heads, h * w)
            # count pixels per patch instead of materialising [b, heads, H, W]: a kept patch
            # contributes all of its valid pixels to the prediction, its foreground ones to the overlap
            idx = src.expand(b, -1)
            fg_per_patch = torch.zeros(b, h * w, dtype=torch.float64).scatter_add_(1, idx, gt.double())
            valid_per_patch = torch.zeros(b, h * w, dtype=torch.float64).scatter_add_(1, idx, v.double())
            keep = keep.double()
            inter = (keep * fg_per_patch[:, None]).sum(-1)  # [b, heads]
            pred_area = (keep * valid_per_patch[:, None]).sum(-1)
        else:
            up = F.interpolate(blk, size=(hh, ww), mode="bilinear", align_corners=False)
            pred = _mass_threshold(up.reshape(b * heads, hh * ww), threshold).view(b, heads, -1) & v[:, None]
            inter = (pred & gt[:, None]).sum(-1).double()
            pred_area = pred.sum(-1).double()
        union = pred_area + gt.sum(-1, keepdim=True).double() - inter
        per_sample[s : s + b] = torch.where(union > 0, inter / union.clamp_min(1), torch.ones_like(union))

    per_head = per_sample.mean(dim=0)
    best_head = int(per_head.argmax())
    return {
        "per_head": per_head,
        "per_sample": per_sample,
        "best_head": best_head,
        "best": float(per_head[best_head]),
    }
