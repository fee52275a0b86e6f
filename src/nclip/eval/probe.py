"""Protocols 4-6 on frozen image backbone features ("features": the final-norm [CLS] token, not
a head output -- xCLIP Sec. 4.2.1 "We use [CLS] token for classification").

4. Linear probe (CLIP App. A.3, the default): multinomial logistic regression by full-batch L-BFGS;
   the L2 strength is chosen on a stratified validation split of the training set, then the model
   is refit on the whole training set (:func:`metrics.linear_probe`). L-BFGS on a closed-form
   objective has no schedule to tune, is deterministic, and takes seconds on CPU. ``--probe sgd``
   runs the papers' own SGD recipes instead (xCLIP Sec. 4.2.1's learning-rate sweep, CMSF's
   CompRess protocol, ProtoCLIP App. B; :func:`metrics.sgd_linear_probe`).
5. Weighted k-NN (InstDisc / DINO): k = 20 neighbours by cosine, votes exp(cos / T), T = 0.07.
6. Clustering (ProtoCLIP App. E, Tab. A.12c): K-Means with K = number of classes on the test
   features, compared with the classes by ARI and AMI.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from nclip.eval.metrics import (
    cluster_scores,
    knn_predict,
    linear_probe,
    mean_per_class_recall,
    sgd_linear_probe,
    stratified_split,
)
from nclip.eval.settings import L2_GRID

SMALL = 5e7  # below this many multiply-adds per gradient step, one thread is fastest


@contextmanager
def threads(n: int | None):
    """Run the block with ``n`` torch / BLAS / OpenMP threads (None: leave them alone).

    The protocols are many small ops (L-BFGS steps on [N, d] x [d, C], K-Means, t-SNE): with
    intra-op parallelism on a shared 2-core machine they run up to 30x slower than on one thread
    (measured: 46 ms vs 1.4 ms per logistic-regression gradient step at load 6).
    """
    if n is None:
        yield
        return
    from threadpoolctl import threadpool_limits

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        with threadpool_limits(limits=n):
            yield
    finally:
        torch.set_num_threads(before)


def linear(train_x, train_y, test_x, test_y, num_classes: int, l2_grid=L2_GRID, seed: int = 0,
           max_iter: int = 150) -> dict[str, float]:
    """{"top1", "mean_per_class", "l2"} of a linear probe; L2 picked on a validation split, refit.

    ``max_iter`` L-BFGS iterations per fit: the L2 grid is walked as a warm-started regularisation
    path, so each fit starts near its optimum; on the tiny preset, 150 iterations change top-1 by
    < 1 point relative to 300 at half the cost.
    """
    x = torch.as_tensor(train_x)
    with threads(1 if x.numel() * num_classes < SMALL else None):
        r = linear_probe(train_x, train_y, test_x, test_y, num_classes, l2_grid=l2_grid, val_fraction=VAL_FRACTION,
                         seed=seed, max_iter=max_iter)
    return {"top1": r["top1"], "mean_per_class": r["mean_per_class"], "l2": r["l2"]}


def sgd_linear(train_x, train_y, test_x, test_y, num_classes: int, recipe: str, epochs: int | None = None,
               seed: int = 0) -> dict[str, float]:
    """{"top1", "mean_per_class", "lr"} of a paper's SGD linear probe (:mod:`.metrics.sgd_linear`)."""
    with threads(1 if torch.as_tensor(train_x).numel() * num_classes < SMALL else None):
        r = sgd_linear_probe(train_x, train_y, test_x, test_y, num_classes, recipe=recipe, epochs=epochs,
                             val_fraction=VAL_FRACTION, seed=seed)
    return {"top1": r["top1"], "mean_per_class": r["mean_per_class"], "lr": r["lr"]}


VAL_FRACTION = 0.2  # the share of each class held out to choose the L2 strength / learning rate


def can_validate(train_y) -> bool:
    """Whether the probes' stratified validation split (:func:`stratified_split`) leaves any
    validation row: some class needs at least 3 training samples."""
    return len(train_y) > 0 and len(stratified_split(train_y, VAL_FRACTION)[1]) > 0


def selects(settings) -> bool:
    """Whether the linear probe of ``settings`` chooses among candidates on a validation split."""
    if settings.probe == "sgd":
        from nclip.eval.sgd_recipes import SGD_RECIPES

        return len(SGD_RECIPES[settings.probe_recipe].lrs) > 1
    return len(settings.l2_grid) > 1


def knn(train_x, train_y, test_x, test_y, num_classes: int, k: int = 20, temperature: float = 0.07) -> dict[str, float]:
    """{"top1", "mean_per_class"} of weighted k-NN classification."""
    pred = knn_predict(train_x, train_y, test_x, num_classes, k=k, temperature=temperature)
    test_y = torch.as_tensor(test_y).long()
    return {"top1": (pred == test_y).double().mean().item(),
            "mean_per_class": mean_per_class_recall(pred, test_y, num_classes)}


def cluster(x, y, seed: int = 0, n_init: int = 3) -> dict[str, float]:
    """{"ari", "ami", "nmi"} of K-Means (K = #classes present) on L2-normalised features."""
    r = cluster_scores(x, y, seed=seed, n_init=n_init)
    return {"ari": r["ari"], "ami": r["ami"], "nmi": r["nmi"]}
