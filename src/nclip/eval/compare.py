"""``nclip eval compare``: several evaluations side by side, as the papers print them.

One markdown table per task, one row per run, columns per dataset (and metric) -- the layout of
xCLIP Tab. 1 (zero-shot, with an Average column), Tab. 4 (retrieval: I→T and T→I R@1/5/10 per
dataset) and Tab. 5 (linear probe, with Average). Every run after the first shows its delta to the
first run in parentheses. Values are percentages (STS: Spearman x 100), as in the papers. Results
of ``nclip eval --suite`` add the suite's table (a column per dataset, and the mean) on top
(:mod:`nclip.eval.suite_table`).

Runs that differ in training steps, training data or evaluation settings are flagged rather than
silently tabulated side by side: one ``differs:`` line per such setting, on stderr and in the
markdown (:func:`differences`).
"""

from __future__ import annotations

from pathlib import Path

from nclip.errors import NclipError
from nclip.eval.report import fmt
from nclip.eval.runner import load_results

# (title, task, metrics per dataset (label, metric), add an Average column)
TABLES = [
    ("Zero-shot classification, top-1 (cf. xCLIP Tab. 1)", "zeroshot", [("", "top1")], True),
    ("Zero-shot image-text retrieval (cf. xCLIP Tab. 4)", "retrieval",
     [("I→T R@1", "i2t@1"), ("I→T R@5", "i2t@5"), ("I→T R@10", "i2t@10"),
      ("T→I R@1", "t2i@1"), ("T→I R@5", "t2i@5"), ("T→I R@10", "t2i@10")], False),
    ("Zero-shot multi-label (cf. xCLIP Tab. 3)", "multilabel",
     [("mAP", "mAP"), ("F1@3", "f1@3"), ("F1@5", "f1@5"), ("F1@10", "f1@10"), ("F1@20", "f1@20")], False),
    ("Linear probe, top-1 (cf. xCLIP Tab. 5)", "linear", [("", "top1")], True),
    ("k-NN (k=20, T=0.07), top-1", "knn", [("", "top1")], True),
    ("K-Means clustering (cf. ProtoCLIP Tab. A.12c)", "cluster", [("ARI", "ari"), ("AMI", "ami")], False),
    ("Realm-wise linear probe, top-1 (cf. OmniBenchmark Tab. 1)", "realms",
     [("", "top1"), ("mean", "mean_top1"), ("rel.", "relative"), ("mean rel.", "mean_relative")], False),
    ("Text STS, Spearman x 100 (cf. xCLIP Tab. 7)", "sts", [("", "spearman")], True),
    ("Mask probing, Jaccard (cf. xCLIP Tab. D3)", "masks", [("", "jaccard")], False),
    ("End-to-end fine-tuning, top-1 (cf. xCLIP Tab. 6)", "finetune", [("", "top1")], True),
    ("Representation diagnostics", "diagnostics",
     [("erank f", "erank_image_features"), ("erank g", "erank_image_emb"), ("align", "alignment_emb"),
      ("unif", "uniformity_image_emb"), ("proto ppl", "proto_perplexity_image")], False),
]


def _name(doc: dict, path: str) -> str:
    ck = doc.get("checkpoint") or {}
    p = Path(ck.get("path") or path)
    label = p.name if p.name not in ("model", "results.json", "eval.json") else p.parent.name
    if ck.get("objective"):
        label += f" ({ck['objective']}, {ck.get('head', '?')} head)"
    return label


def _cell(metric: str, value, base) -> str:
    if value is None:
        return "–"
    text = fmt(metric, value)
    if base is None or metric in ("l2", "lr", "best_head"):
        return text
    if metric.startswith(("erank", "align", "unif", "proto")):  # raw numbers, not percentages
        return f"{text} ({value - base:+.3g})"
    return f"{text} ({100.0 * (value - base):+.1f})"


# Settings that make two evaluations incomparable when they differ: (label, where in results.json).
# The trainer's eval.json carries none of them; a run without a value is left out of the check.
SETTINGS = [
    ("training steps", ("checkpoint", "train_steps")), ("training data", ("checkpoint", "data_source")),
    ("image size", ("checkpoint", "image_size")), ("eval datasets", ("config", "datasets")),
    ("eval test samples (--samples)", ("config", "test_samples")),
    ("eval probe training samples (--train-samples)", ("config", "train_samples")),
    ("eval seed", ("config", "seed")), ("eval STS pairs", ("config", "sts_pairs")),
    ("eval mask samples", ("config", "mask_samples")), ("eval mask threshold", ("config", "mask_threshold")),
    ("eval segmentation background threshold", ("config", "segment_threshold")),
    ("eval VOC class names (--voc-classnames)", ("config", "voc_classnames")),
    ("eval templates (--templates)", ("config", "templates")),
    ("probe features", ("config", "probe_features")), ("nCLIP score", ("config", "nclip_score")),
    ("k-NN k", ("config", "knn_k")), ("k-NN temperature", ("config", "knn_temperature")),
    ("linear-probe L2 grid", ("config", "l2_grid")), ("realm baseline", ("config", "baseline")),
    ("fine-tuning label fraction", ("config", "fraction")), ("fine-tuning epochs", ("config", "epochs")),
    ("fine-tuning classifier", ("config", "classifier")), ("fine-tuning dataset", ("config", "dataset")),
]


def differences(docs: list[dict], names: list[str]) -> list[str]:
    """One "differs: ..." line per setting of :data:`SETTINGS` on which the runs disagree, naming
    each run's value, so that a table of incomparable numbers never goes unflagged."""
    out = []
    for label, (section, key) in SETTINGS:
        values = [(n, (d.get(section) or {}).get(key)) for d, n in zip(docs, names)]
        values = [(n, v) for n, v in values if v is not None]
        if len({repr(v) for _, v in values}) > 1:
            shown = "; ".join(f"{n}: {', '.join(map(str, v)) if isinstance(v, list) else v}" for n, v in values)
            out.append(f"differs: {label} ({shown})")
    return out


def markdown(paths: list[str | Path], warn=None) -> str:
    """The comparison as markdown; ``warn(line)`` hears each "differs:" line (the CLI: stderr),
    which the markdown also lists under the runs."""
    if len(paths) < 1:
        raise NclipError("compare needs at least one evaluation")
    docs = [load_results(p) for p in paths]
    names = [_name(d, str(p)) for d, p in zip(docs, paths)]
    seen: dict[str, int] = {}
    for i, n in enumerate(names):  # make duplicate labels distinct
        seen[n] = seen.get(n, 0) + 1
        if seen[n] > 1:
            names[i] = f"{n} #{seen[n]}"
    results = [d["results"] for d in docs]
    lines = ["# nclip eval compare", ""]
    lines += [f"{i + 1}. **{n}**: `{d['source']}`" + (f" (weights `{d['checkpoint']['weights_sha256'][:12]}`)"
                                                      if d.get("checkpoint", {}).get("weights_sha256") else "")
              for i, (n, d) in enumerate(zip(names, docs))]
    differs = differences(docs, names)
    for line in differs:
        if warn is not None:
            warn(line)
    if differs:
        lines += ["", "**Warning: these runs are not comparable as they stand; the settings that differ:**", ""]
        lines += [f"- {line}" for line in differs]
    lines += ["", "Percentages (STS: Spearman x 100); in parentheses the difference to run 1, in points."]
    suites = [(d["suite"], n) for d, n in zip(docs, names) if isinstance(d.get("suite"), dict)]
    if suites:  # nclip eval --suite results: the papers' suite table first
        from nclip.eval.suite_table import markdown as suite_markdown

        lines += suite_markdown([s for s, _ in suites], [n for _, n in suites])
    for title, task, metrics, average in TABLES:
        datasets = sorted({k.split("/")[1] for r in results for k in r if k.startswith(task + "/")})
        cols = [(f"{d} {label}".strip(), f"{task}/{d}/{m}", m) for d in datasets for label, m in metrics
                if any(f"{task}/{d}/{m}" in r for r in results)]
        if not cols:
            continue
        head = ["run"] + [c[0] for c in cols] + (["Average"] if average and len(cols) > 1 else [])
        rows = []
        first_avg = None
        for i, r in enumerate(results):
            cells = [names[i]]
            for _, key, m in cols:
                cells.append(_cell(m, r.get(key), results[0].get(key) if i else None))
            if average and len(cols) > 1:
                common = [key for _, key, _ in cols if all(key in rr for rr in results)]
                avg = sum(r[k] for k in common) / len(common) if common else None
                first_avg = avg if i == 0 else first_avg
                cells.append(_cell(cols[0][2], avg, first_avg if i else None))
            rows.append(cells)
        lines += ["", f"## {title}", "", "| " + " | ".join(head) + " |",
                  "|" + "|".join([":---"] + ["---:"] * (len(head) - 1)) + "|"]
        lines += ["| " + " | ".join(c) + " |" for c in rows]
    return "\n".join(lines) + "\n"
