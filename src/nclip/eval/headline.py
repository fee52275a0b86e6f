"""The report's headline cards: one number per task, chosen by the metric's name.

results.json sorts its keys, so a task's first metric is whatever sorts first ("chance" before
"top1", "l2" before "top1"): a card picked by position would show the chance level as zero-shot
accuracy. Each task names its headline metric here instead; a task without one
(diagnostics) gets no card.
"""

from __future__ import annotations

# task -> (metric, card label), in the order of the cards; the numbers the papers lead with
HEADLINE: dict[str, tuple[str, str]] = {
    "zeroshot": ("top1", "zero-shot top-1"),
    "retrieval": ("mean_recall", "retrieval mean R@k"),
    "multilabel": ("mAP", "multi-label mAP"),
    "finetune": ("top1", "fine-tuned top-1"),
    "linear": ("top1", "linear probe top-1"),
    "knn": ("top1", "k-NN top-1"),
    "cluster": ("ari", "K-Means ARI"),  # as `nclip eval` prints it; adjusted for chance (0: random clusters)
    "realms": ("mean_top1", "realm mean top-1"),
    "sts": ("spearman", "STS Spearman"),
    "masks": ("jaccard", "mask Jaccard"),
}

# of several datasets with the headline metric, the built-in benchmark's main labels come first
# (the synthetic scenes' shape, as the README's numbers), then results.json's order
_PREFERRED_DATASETS = ("synthetic-shape", "synthetic")


def headline_picks(results: dict[str, float]) -> list[tuple[str, str]]:
    """(label, key) of the headline cards: per task of :data:`HEADLINE` with its metric in
    ``results`` (keys ``task/dataset/metric``), the key of one dataset."""
    picks = []
    for task, (metric, label) in HEADLINE.items():
        keys = [k for k in results if k.split("/", 2)[::2] == [task, metric]]
        if keys:
            keys.sort(key=lambda k: _rank(k.split("/")[1]))  # stable: results.json's order among the rest
            picks.append((label, keys[0]))
    return picks


def _rank(dataset: str) -> int:
    return _PREFERRED_DATASETS.index(dataset) if dataset in _PREFERRED_DATASETS else len(_PREFERRED_DATASETS)
