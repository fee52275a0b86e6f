"""Which series of a run's metrics.jsonl go on which panel of the report's training curves, under
which y-axis unit.

A panel holds one kind of quantity, so that its axis has one unit: an objective's series are
grouped by their prefix (``nclip/``, ``cmsf/``, ...) and their kind, read from the series' name
(``L_*`` and ``loss``: nats; ``acc*``, ``usage``, ``purity``: fractions; ``*std``: standard
deviations of probabilities or logits; ...). Before issue 28.13 the nCLIP head's accuracy and
standard deviations shared a panel under a "nats" axis, and its title ("nclip terms") repeated
the loss panel's ("nCLIP terms") but for the case. A panel whose every value is zero (the count of
skipped samples of a clean run) is left out, and named under the figure instead.
"""

from __future__ import annotations

import math
from typing import NamedTuple

# kind -> (y-axis label with its unit, what a panel of that kind is called after its prefix)
KINDS: dict[str, tuple[str, str]] = {
    "loss": ("loss (nats)", "terms"),
    "fraction": ("fraction (0 to 1)", "accuracies and shares"),
    "prob_std": ("std of probabilities", "standard deviations of P"),
    "logit_std": ("std of logits", "standard deviations of logits"),
    "logit": ("logit", "logits"),
    "coefficient": ("coefficient (no unit)", "coefficients"),
    "count": ("count", "counts"),
    "value": ("value (unit unknown)", "other series"),
}

# the run's own series, each on its panel; (title, key, y-axis label)
_OWN = {"loss": ("total loss", "loss (nats)"), "logit_scale": ("logit scale 1/σ", "1/σ (multiplier)"),
        "lr": ("learning rate", "lr (per step)"), "grad_norm": ("gradient norm", "‖g‖₂ (before clipping)")}
# shown elsewhere or not a curve: throughput, host wait and the non-finite count are the run's
# health (the logbook prints them); nclip/loss is L_nCLIP's weighted sum of the L_* terms drawn
# (eval_s: the wall-clock seconds of an evaluation while training)
NOT_DRAWN = frozenset({"step", "samples_per_s", "data_wait_s", "eval_s", "nonfinite_steps", "nclip/loss"})
# the evaluation while training's metrics (train.eval_every: "eval/<task>/<dataset>/<metric>"), all
# fractions: accuracies, recalls, mean average precision, clustering agreement
EVAL_FRACTIONS = ("top1", "top5", "mean_per_class", "mean_recall", "map", "ari", "ami", "nmi")
EVAL_FRACTION_PREFIXES = ("i2t@", "t2i@", "f1@", "precision@", "recall@")

_PREFIX_NAMES = {"clip": "CLIP", "nclip": "nCLIP", "cmsf": "CMSF", "siglip": "SigLIP", "proto": "ProtoCLIP",
                 "yclip": "yCLIP", "xent": "classifier", "supcon": "SupCon", "unified": "unified", "data": "data"}
# panels the papers name; the rest are "<prefix name> <kind's panel word>"
_TITLES = {("clip", "loss"): "InfoNCE (CLIP head)", ("nclip", "loss"): "nCLIP terms",
           ("clip", "fraction"): "CLIP in-batch accuracy", ("clip", "logit"): "CLIP logits (pos / neg)",
           ("nclip", "fraction"): "nCLIP head: accuracy and prototype usage",
           ("nclip", "prob_std"): "nCLIP head: row / column std of P",
           ("nclip", "logit_std"): "nCLIP head: row / column std of logits",
           ("nclip", "coefficient"): "nCLIP weight λ", ("data", "count"): "skipped data samples"}
# the evaluation while training's tasks (nclip.train.periodic_eval), as panel titles name them
_EVAL_TASKS = {"zeroshot": "zero-shot classification", "retrieval": "image-text retrieval", "knn": "k-NN",
               "linear": "linear probe"}
# panel order: the total loss, the CLIP and nCLIP heads, the run's own series, then the rest by name
_FIRST = ("clip", "nclip")


class Panel(NamedTuple):
    title: str
    keys: list[str]
    ylabel: str


def series_kind(key: str) -> str:
    """The kind of quantity a logged series is, from its name (a key of :data:`KINDS`)."""
    name = key.rsplit("/", 1)[-1].lower()
    if name == "loss" or name.startswith("l_") or name.endswith("_loss"):
        return "loss"
    if "std" in name:  # nclip's row_std / col_std are of P = softmax(logits); logit_*_std of the logits
        return "logit_std" if name.startswith("logit") else "prob_std"
    if name.startswith("logit"):
        return "logit"
    if (name.startswith("acc") or name.endswith(("_acc", "fill", "usage", "purity", "fraction", "share"))
            or name in EVAL_FRACTIONS or name.startswith(EVAL_FRACTION_PREFIXES)):
        return "fraction"
    if name.startswith(("lambda", "tau", "t_", "temperature", "momentum", "weight")):
        return "coefficient"
    if name in ("skipped", "neighbours") or name.endswith("_size"):
        return "count"
    return "value"


def numeric_keys(rows: list[dict]) -> list[str]:
    """The numeric series of ``rows`` in the order they first appear (lists and flags are not curves)."""
    keys: dict[str, None] = {}
    for row in rows:
        for k, v in row.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                keys.setdefault(k, None)
    return list(keys)


def _all_zero(rows: list[dict], keys: list[str]) -> bool:
    values = [r[k] for r in rows for k in keys if isinstance(r.get(k), (int, float)) and math.isfinite(r[k])]
    return all(v == 0 for v in values)


def curve_panels(rows: list[dict]) -> tuple[list[Panel], list[str]]:
    """The panels of the training-curves figure for metrics.jsonl ``rows``, and the series left
    out because they are zero at every logged step (so the page can name them)."""
    keys = [k for k in numeric_keys(rows) if k not in NOT_DRAWN]
    groups: dict[tuple[str, str], list[str]] = {}
    for k in keys:
        if k in _OWN:
            continue
        prefix = k.split("/", 1)[0] if "/" in k else "other"
        if prefix == "eval" and k.count("/") >= 2:  # a panel per task: zero-shot top-1 apart from retrieval R@k
            prefix = "/".join(k.split("/")[:2])
        groups.setdefault((prefix, series_kind(k)), []).append(k)
    kind_order = list(KINDS)

    def group_panel(prefix: str, kind: str) -> Panel:
        title = _TITLES.get((prefix, kind), f"{_PREFIX_NAMES.get(prefix, prefix)} {KINDS[kind][1]}")
        if prefix.startswith("eval/"):
            title = f"evaluation while training: {_EVAL_TASKS.get(prefix[5:], prefix[5:])}"
        return Panel(title, groups[(prefix, kind)], KINDS[kind][0])

    first = [g for p in _FIRST for g in sorted(groups, key=lambda g: kind_order.index(g[1])) if g[0] == p]
    rest = sorted((g for g in groups if g[0] not in _FIRST), key=lambda g: (g[0], kind_order.index(g[1])))
    own = {k: Panel(_OWN[k][0], [k], _OWN[k][1]) for k in _OWN if k in keys}
    total = [own.pop("loss")] if "loss" in own else []
    panels = total + [group_panel(*g) for g in first] + list(own.values()) + [group_panel(*g) for g in rest]
    drawn = [p for p in panels if not _all_zero(rows, p.keys)]
    dropped = [k for p in panels if p not in drawn for k in p.keys]
    return drawn, dropped
