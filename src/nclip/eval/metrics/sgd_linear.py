"""The papers' SGD linear probes on frozen features, beside the L-BFGS one of :mod:`.linear`.

The recipes are one table, :data:`nclip.eval.sgd_recipes.SGD_RECIPES`, each as its paper states it.

Where a recipe sweeps learning rates (``xclip``), the papers report the best head on the evaluation
set. nclip instead picks the head on a seeded stratified validation split of the training set (the
same split as the L-BFGS probe's L2 selection), refits that learning rate on the whole training set
and reports the test accuracy; the validation accuracy of every head is returned beside it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from nclip.eval.metrics._common import as_float, as_labels, positive_int
from nclip.eval.metrics.classification import mean_per_class_recall
from nclip.eval.metrics.linear import stratified_split
from nclip.eval.sgd_recipes import SGD_RECIPES, SgdRecipe


def _lr_factor(recipe: SgdRecipe, epochs: int):
    """The per-epoch learning-rate multiplier of the recipe's schedule."""
    if recipe.schedule == "cosine":  # iBOT / MoCo: cosine from the base rate to 0 over the epochs
        return lambda epoch: 0.5 * (1.0 + math.cos(math.pi * epoch / epochs))
    scale = epochs / recipe.epochs  # milestones keep their place in a shortened (or longer) schedule
    return lambda epoch: 0.1 ** sum(epoch >= round(m * scale) for m in recipe.milestones)


def _train_heads(x, y, num_classes: int, lrs, recipe: SgdRecipe, epochs: int, seed: int) -> list[torch.Tensor]:
    """One linear head per learning rate, trained on the same seeded minibatch order; returns
    [W | b] of shape [d + 1, C] per head. Heads start alike: N(0, 0.01) weights, zero bias (DINO /
    iBOT's linear classifier)."""
    g = torch.Generator().manual_seed(int(seed))
    d = x.shape[1]
    w0 = torch.randn(d, num_classes, generator=g, dtype=x.dtype) * 0.01
    heads = [torch.cat([w0, torch.zeros(1, num_classes, dtype=x.dtype)]).requires_grad_(True) for _ in lrs]
    opt = torch.optim.SGD([{"params": [h], "lr": lr} for h, lr in zip(heads, lrs)], momentum=recipe.momentum,
                          weight_decay=recipe.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, _lr_factor(recipe, epochs))
    xb = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)  # the bias as a constant input
    with torch.enable_grad():
        for _ in range(epochs):
            order = torch.randperm(len(x), generator=g)
            for start in range(0, len(x), recipe.batch_size):
                rows = order[start:start + recipe.batch_size]
                opt.zero_grad(set_to_none=True)
                # one batched product for all heads; each head's mean loss depends only on its own
                # weights, so the summed loss gives every head its own gradient
                logits = torch.matmul(xb[rows], torch.stack(heads))  # [H, b, C]
                loss = F.cross_entropy(logits.flatten(0, 1), y[rows].repeat(len(heads)), reduction="sum")
                (loss / len(rows)).backward()
                opt.step()
            schedule.step()
    return [h.detach() for h in heads]


def _normalised(xtr: torch.Tensor, xte: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CompRess: unit L2 norm, then zero mean / unit variance per dimension (training statistics)."""
    xtr, xte = F.normalize(xtr, dim=1), F.normalize(xte, dim=1)
    mean, std = xtr.mean(0), xtr.std(0)
    std = torch.where(std > 0, std, torch.ones_like(std))
    return (xtr - mean) / std, (xte - mean) / std


def _predict(x: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    return (x @ head[:-1] + head[-1]).argmax(1)


def sgd_linear_probe(train_x, train_y, test_x, test_y, num_classes: int, recipe: str = "xclip",
                     epochs: int | None = None, val_fraction: float = 0.2, seed: int = 0) -> dict:
    """A linear classifier trained by SGD on frozen features, by one paper's recipe (``SGD_RECIPES``).

    Args:
        train_x: [N_train, d]; train_y: int [N_train]; test_x: [N_test, d]; test_y: int [N_test].
        recipe: ``xclip``, ``cmsf`` or ``protoclip``.
        epochs: overrides the recipe's epochs (step milestones scale with it); None: the paper's.
        val_fraction: the held-out part of each class for choosing among several learning rates.
        seed: seeds the validation split, the heads' initialisation and the minibatch order.

    Returns:
        ``{"top1", "mean_per_class", "lr": the chosen rate, "val_top1": {lr: validation top-1}}``
        (``val_top1`` empty when the recipe has one rate).
    """
    if recipe not in SGD_RECIPES:
        raise ValueError(f"unknown SGD probe recipe {recipe!r}; available: {', '.join(SGD_RECIPES)}")
    spec = SGD_RECIPES[recipe]
    num_classes = positive_int(num_classes, "num_classes")
    epochs = positive_int(epochs if epochs is not None else spec.epochs, "epochs")
    xtr, xte = as_float(train_x, "train_x", 2), as_float(test_x, "test_x", 2)
    if xtr.shape[1] != xte.shape[1]:
        raise ValueError(f"train_x has {xtr.shape[1]} feature dims but test_x has {xte.shape[1]}")
    ytr = as_labels(train_y, "train_y", len(xtr), num_classes)
    yte = as_labels(test_y, "test_y", len(xte), num_classes)
    if spec.normalise:
        xtr, xte = _normalised(xtr, xte)
    val_scores: dict[float, float] = {}
    lr = spec.lrs[0]
    if len(spec.lrs) > 1:
        fit, val = stratified_split(ytr, val_fraction, seed)
        if not len(val):
            raise ValueError(f"val_fraction={val_fraction} leaves no validation rows for {len(ytr)} train rows "
                             "to choose the learning rate")
        heads = _train_heads(xtr[fit], ytr[fit], num_classes, spec.lrs, spec, epochs, seed)
        for rate, head in zip(spec.lrs, heads):
            val_scores[rate] = (_predict(xtr[val], head) == ytr[val]).double().mean().item()
        lr = max(spec.lrs, key=lambda rate: val_scores[rate])  # ties: the first (smallest) rate
    head = _train_heads(xtr, ytr, num_classes, (lr,), spec, epochs, seed)[0]
    pred = _predict(xte, head)
    return {"top1": (pred == yte).double().mean().item(),
            "mean_per_class": mean_per_class_recall(pred, yte, num_classes), "lr": lr, "val_top1": val_scores}
