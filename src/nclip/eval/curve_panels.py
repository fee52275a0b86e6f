"""Which series of a run's metrics.jsonl go on which panel of the report's training curves, under
which y-axis unit.

A panel holds one kind of quantity, so that its axis has one unit: an objective's series are
grouped by their prefix (``nclip/``, ``cmsf/``, ...) and their kind, read from the series' name
(``L_*`` and ``loss``: nats; ``acc*``, ``usage``, ``purity``: fractions; ``*std``: standard
deviations of probabilities or logits; ...). Grouped by prefix alone, the nCLIP head's accuracy
and standard deviations would share a panel under a "nats" axis, and its title ("nclip terms")
would repeat the loss panel's ("nCLIP terms") but for the case. A panel whose every value is zero (the count of
skipped samples of a clean run) is left out, and named under the figure instead.

Evaluation while training (``eval/<task>/<dataset>/<metric>``, :mod:`nclip.train.periodic_eval`)
gets a panel per task and metric family, each line named by its dataset and label kind (named by
the metric alone, five legend entries all read "top1" on one "unit unknown" axis), and ``eval_s`` a timing panel in
seconds. No panel reads "unknown": a series nclip does not know is drawn "as logged".
"""

from __future__ import annotations

import math
from typing import NamedTuple

from nclip.eval.settings import TASK_TABLE

# kind -> (y-axis label with its unit, what a panel of that kind is called after its prefix)
KINDS: dict[str, tuple[str, str]] = {
    "loss": ("loss (nats)", "terms"),
    "fraction": ("fraction (0 to 1)", "accuracies and shares"),
    "prob_std": ("std of probabilities", "standard deviations of P"),
    "logit_std": ("std of logits", "standard deviations of logits"),
    "logit": ("logit", "logits"),
    "coefficient": ("coefficient (no unit)", "coefficients"),
    "count": ("count", "counts"),
    "value": ("value, as logged", "other series"),
}

# the run's own series, each on its panel; (title, key, y-axis label)
_OWN = {"loss": ("total loss", "loss (nats)"), "logit_scale": ("logit scale 1/σ", "1/σ (multiplier)"),
        "lr": ("learning rate", "lr (per step)"), "grad_norm": ("gradient norm", "‖g‖₂ (before clipping)")}
# shown elsewhere or not a curve: throughput, host wait and the non-finite count are the run's
# health (the logbook prints them); nclip/loss is L_nCLIP's weighted sum of the L_* terms drawn
NOT_DRAWN = frozenset({"step", "samples_per_s", "data_wait_s", "nonfinite_steps", "nclip/loss"})

_PREFIX_NAMES = {"clip": "CLIP", "nclip": "nCLIP", "cmsf": "CMSF", "siglip": "SigLIP", "proto": "ProtoCLIP",
                 "yclip": "yCLIP", "xent": "classifier", "supcon": "SupCon", "unified": "unified", "data": "data"}
# panels the papers name; the rest are "<prefix name> <kind's panel word>"
_TITLES = {("clip", "loss"): "InfoNCE (CLIP head)", ("nclip", "loss"): "nCLIP terms",
           ("clip", "fraction"): "CLIP in-batch accuracy", ("clip", "logit"): "CLIP logits (pos / neg)",
           ("nclip", "fraction"): "nCLIP head: accuracy and prototype usage",
           ("nclip", "prob_std"): "nCLIP head: row / column std of P",
           ("nclip", "logit_std"): "nCLIP head: row / column std of logits",
           ("nclip", "coefficient"): "nCLIP weight λ", ("data", "count"): "skipped data samples"}
# panel order: the total loss, the CLIP and nCLIP heads, the run's own series, then the rest by name
_FIRST = ("clip", "nclip")


class Panel(NamedTuple):
    title: str
    keys: list[str]
    ylabel: str
    labels: list[str] | None = None  # the legend's name of each key (None: the key's last part)


# evaluation while training: a task's name on a panel is its title (nclip.eval.settings.TASK_TABLE);
# metric family -> (its name, y-axis label)
_EVAL_METRICS = {"top1": ("top-1", "top-1 accuracy (0 to 1)"), "top5": ("top-5", "top-5 accuracy (0 to 1)"),
                 "recall": ("recall@k", "recall (0 to 1)"), "mAP": ("mAP", "mean average precision (0 to 1)"),
                 "spearman": ("Spearman ρ", "Spearman correlation (-1 to 1)")}
_TIMINGS = {"eval_s": "evaluation while training"}


def _eval_family(metric: str) -> str:
    return "recall" if metric == "mean_recall" or "@" in metric else metric


def eval_panels(keys: list[str]) -> list[Panel]:
    """The panels of the evaluation-while-training series among ``keys``: one per (task, metric
    family), a line per dataset and label kind (and metric, where a family has several), then one
    timing panel in seconds."""
    groups: dict[tuple[str, str], list[tuple[str, str, str]]] = {}
    for k in keys:
        parts = k.split("/")
        if len(parts) == 4 and parts[0] == "eval":
            _, task, dataset, metric = parts
            groups.setdefault((task, _eval_family(metric)), []).append((k, dataset, metric))
    panels = []
    for (task, family), found in groups.items():
        name, ylabel = _EVAL_METRICS.get(family, (family, f"{family}, as logged"))
        several = len({m for _, _, m in found}) > 1
        labels = [f"{d} {m}" if several else d for _, d, m in found]
        title = TASK_TABLE[task].title if task in TASK_TABLE else task
        panels.append(Panel(f"eval while training: {title} {name}", [k for k, _, _ in found], ylabel, labels))
    timings = [k for k in _TIMINGS if k in keys]
    if timings:
        panels.append(Panel("time spent evaluating", timings, "seconds per evaluation", [_TIMINGS[k] for k in timings]))
    return panels


def series_kind(key: str) -> str:
    """The kind of quantity a logged series is, from its name (a key of :data:`KINDS`)."""
    name = key.rsplit("/", 1)[-1].lower()
    if name == "loss" or name.startswith("l_") or name.endswith("_loss"):
        return "loss"
    if "std" in name:  # nclip's row_std / col_std are of P = softmax(logits); logit_*_std of the logits
        return "logit_std" if name.startswith("logit") else "prob_std"
    if name.startswith("logit"):
        return "logit"
    if name.startswith("acc") or name.endswith(("_acc", "fill", "usage", "purity", "fraction", "share")):
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
    evals = eval_panels(keys)
    evaluated = {k for p in evals for k in p.keys}
    groups: dict[tuple[str, str], list[str]] = {}
    for k in keys:
        if k in _OWN or k in evaluated:
            continue
        prefix = k.split("/", 1)[0] if "/" in k else "other"
        groups.setdefault((prefix, series_kind(k)), []).append(k)
    kind_order = list(KINDS)

    def group_panel(prefix: str, kind: str) -> Panel:
        if (prefix, kind) in _TITLES:
            title = _TITLES[(prefix, kind)]
        elif prefix == "other":  # series without a prefix: "other series", not "other other series"
            title = KINDS[kind][1]
        else:
            title = f"{_PREFIX_NAMES.get(prefix, prefix)} {KINDS[kind][1]}"
        return Panel(title, groups[(prefix, kind)], KINDS[kind][0])

    first = [g for p in _FIRST for g in sorted(groups, key=lambda g: kind_order.index(g[1])) if g[0] == p]
    rest = sorted((g for g in groups if g[0] not in _FIRST), key=lambda g: (g[0], kind_order.index(g[1])))
    own = {k: Panel(_OWN[k][0], [k], _OWN[k][1]) for k in _OWN if k in keys}
    total = [own.pop("loss")] if "loss" in own else []
    panels = (total + [group_panel(*g) for g in first] + list(own.values()) + [group_panel(*g) for g in rest]
              + evals)
    drawn = [p for p in panels if not _all_zero(rows, p.keys)]
    dropped = [k for p in panels if p not in drawn for k in p.keys]
    return drawn, dropped
