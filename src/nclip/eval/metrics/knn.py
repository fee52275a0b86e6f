"""Weighted k-nearest-neighbour classification (InstDisc / DINO)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nclip.eval.metrics._common import as_float, as_labels, positive_int


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
    num_classes = positive_int(num_classes, "num_classes")
    k = positive_int(k, "k")
    chunk_size = positive_int(chunk_size, "chunk_size")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    tr = as_float(train_features, "train_features", ndim=2)
    te = as_float(test_features, "test_features", ndim=2)
    if tr.shape[0] == 0:
        raise ValueError("train_features is empty")
    if te.shape[1] != tr.shape[1]:
        raise ValueError(
            f"test_features has dimension {te.shape[1]} but train_features has {tr.shape[1]}"
        )
    y = as_labels(train_labels, "train_labels", n=tr.shape[0], num_classes=num_classes)
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
