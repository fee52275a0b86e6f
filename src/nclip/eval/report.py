"""report.html: one self-contained page (inline CSS, figures as base64 PNG) from an evaluation.

Sections: headline numbers; results tables per task (percentages, as the papers print them);
zero-shot confusion matrix; t-SNE of image and text class embeddings (xCLIP Figs. G3-G6: cosine
distance for the CLIP head, symmetrised cross-entropy -- i.e. KL -- for the nCLIP head); retrieval
failure cases (Fig. 5 / D2: the query image, the caption retrieved, the right one); mask probing
examples; realm-wise accuracies; training curves from the run's metrics.jsonl, nCLIP terms
included; the resolved config. Tasks the runner skipped are listed under the tables with their
reasons. The figures are drawn by :mod:`nclip.eval.figures`.
"""

from __future__ import annotations

import html
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

from nclip.eval.headline import headline_picks
from nclip.jsonio import read_jsonl

# metrics shown as percentages (fractions in results.json)
_PERCENT = ("top1", "hardneg_top1", "top5", "mean_per_class", "chance", "mean_recall", "mAP", "ari", "ami", "nmi",
            "jaccard", "miou", "macc",
            "mean_heads", "mean_top1", "relative", "mean_relative",
            "val_top1")
_PERCENT_PREFIX = ("i2t@", "t2i@", "f1@", "precision@", "recall@", "head")
_TASK_TITLES = {
    "zeroshot": "Zero-shot classification (prompt ensembles; Tab. 1)",
    "retrieval": "Zero-shot image-text retrieval (Tab. 4)",
    "multilabel": "Zero-shot multi-label classification (Tab. 3)",
    "linear": "Linear probe on frozen image features (L-BFGS, L2 chosen on validation; Tab. 5)",
    "knn": "Weighted k-NN on frozen image features",
    "cluster": "K-Means clustering of image features (ProtoCLIP Tab. A.12c)",
    "realms": "Realm-wise linear probing (OmniBenchmark Sec. 3.6)",
    "sts": "Text STS: Spearman x 100 of backbone-feature cosine (Tab. 7)",
    "masks": "Mask probing: Jaccard of attention maps vs object masks (Tab. D3)",
    "segmentation": "Zero-shot semantic segmentation of GroupViT's groups: mIoU, mAcc (Tab. 13)",
    "diagnostics": "Representation diagnostics",
    "finetune": "End-to-end fine-tuning (xCLIP Tab. 6, App. C)",
}
_TASK_ORDER = list(_TASK_TITLES)
_TASK_NOTES = {
    "finetune": "{finetune}",
    "linear": "Features: {probe_features}, frozen.",
    "realms": "One probe per realm dataset (on synthetic scenes: the scenes whose main shape is in the realm, "
              "classifying that shape); \"relative\" = accuracy minus the baseline's, in points.",
    "masks": "Per head: mean Jaccard over scenes of the {mask_maps}'s top-60% mass vs the union of object "
             "masks; the best head is retained (as in the paper).",
    "segmentation": "Each pixel goes to its arg-max group of the multiplied grouping assignments; each group to its "
                    "zero-shot class among the image's top 5 (CLIP head, prompt ensemble; GroupViT's score: the "
                    "softmax over those 5 times the full softmax), or background below min({segment_threshold}, "
                    "the image's best group score); mIoU and mAcc over background and the classes, from one "
                    "confusion matrix.",
    "diagnostics": "erank: effective rank (1 = collapsed); alignment (0 = paired embeddings coincide, lower is "
                   "better) and uniformity (more negative = more spread) of the CLIP-head embeddings; proto_*: "
                   "prototypes in use by the nCLIP head's argmax and the perplexity of that histogram; row/col "
                   "std of P = softmax(nCLIP logits) (App. B, Fig. B1).",
}


def _task_notes(config: dict) -> dict[str, str]:
    """The notes under the tables, naming this image tower's features and attention maps (results
    written before towers said so read as the ViT's)."""
    fill = {"probe_features": config.get("probe_features", "image backbone features ([CLS], no projection)"),
            "mask_maps": config.get("mask_maps") or "[CLS] attention",
            "segment_threshold": config.get("segment_threshold", 0.95),
            "finetune": _finetune_note(config)}
    return {task: note.format(**fill) for task, note in _TASK_NOTES.items()}


def _finetune_note(config: dict) -> str:
    """How ``nclip finetune`` trained (its results.json config), or "" for an evaluation."""
    if "fraction" not in config:
        return ""
    return (f"{config['classifier']} classifier on {config.get('features', '?')}; {config['fraction']:g} of the "
            f"training labels ({config.get('train_images', '?')} images); lr {config['lr']:g} and epoch "
            f"{config.get('best_epoch', '?')} of {config['epochs']} chosen on {config.get('val_images', '?')} "
            f"validation images; layer decay {config['layer_decay']:g}, weight decay {config['weight_decay']:g}, "
            f"drop path {config.get('drop_path_applied', config['drop_path'])}." + _wise_note(config))


def _wise_note(config: dict) -> str:
    """The WiSE-FT mixes of ``nclip finetune --wise`` (test top-1 per α), or ""."""
    rows = config.get("wise") or []
    shown = ", ".join(f"α {r['alpha']:g}: {100 * r['top1']:.1f}" for r in rows)
    return (f" WiSE-FT, test top-1 of (1 − α)·zero-shot + α·fine-tuned weights: {shown}." if rows else "")


def _is_percent(metric: str) -> bool:
    return metric in _PERCENT or metric.startswith(_PERCENT_PREFIX)


def fmt(metric: str, value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if metric in ("relative", "mean_relative"):
        return f"{100 * value:+.1f}"
    if _is_percent(metric):
        return f"{100 * value:.1f}"
    if metric.startswith("spearman"):
        return f"{100 * value:.1f}"
    if metric in ("best_head", "pairs") or metric.startswith("proto_used_") and "fraction" not in metric:
        return f"{value:.0f}"
    if metric in ("l2", "lr"):
        return f"{value:.0e}"
    return f"{value:.3g}"


# ---------------------------------------------------------------------------------------------
# tables
# ---------------------------------------------------------------------------------------------


def split_key(key: str) -> tuple[str, str, str]:
    task, _, rest = key.partition("/")
    dataset, _, metric = rest.partition("/")
    return task, dataset, metric


_ORDER = ("top1", "top5", "mean_per_class", "chance", "i2t@", "t2i@", "mean_recall", "mAP", "f1@", "precision@",
          "recall@", "l2", "lr", "ari", "ami", "nmi", "relative", "spearman", "spearman_emb", "pairs", "jaccard",
          "best_head", "mean_heads", "head")


def metric_order(metric: str) -> tuple:
    """Paper-style column order: accuracies, then R@k both ways by k, then the rest; numbers sorted as numbers."""
    base, num = metric, 0
    for i, c in enumerate(metric):
        if c.isdigit() and (metric[:i].endswith("@") or metric[:i] in ("head", "top")):
            base, num = metric[:i], int(metric[i:]) if metric[i:].isdigit() else 0
            break
    if metric in _ORDER:
        return (_ORDER.index(metric), 0, metric)
    if base in _ORDER and base != metric:
        return (_ORDER.index(base), num, metric)
    return (len(_ORDER), 0, metric)


def _tables(results: dict, notes: dict[str, str]) -> str:
    by_task: dict[str, dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    for key, value in results.items():
        task, dataset, metric = split_key(key)
        if task == "realms" and metric in ("mean_top1", "mean_relative"):  # the mean over realms is a row of its own
            dataset, metric = f"{dataset} (mean of realms)", metric[len("mean_"):]
        by_task[task][dataset][metric] = value
    parts = []
    for task in sorted(by_task, key=lambda t: (_TASK_ORDER.index(t) if t in _TASK_ORDER else 99, t)):
        rows = by_task[task]
        metrics = sorted({k for m in rows.values() for k in m}, key=metric_order)
        title = _TASK_TITLES.get(task, task)
        if len(metrics) > 10 and len(rows) < len(metrics):  # wide: one row per metric instead
            head = "".join(f"<th>{html.escape(d)}</th>" for d in rows)
            body = [f'<tr><th class="row">{html.escape(k)}</th>'
                    + "".join(f'<td class="num">{fmt(k, m.get(k))}</td>' for m in rows.values()) + "</tr>"
                    for k in metrics]
            first = "metric"
        else:
            head = "".join(f"<th>{html.escape(m)}</th>" for m in metrics)
            body = [f'<tr><th class="row">{html.escape(d)}</th>'
                    + "".join(f'<td class="num">{fmt(k, m.get(k))}</td>' for k in metrics) + "</tr>"
                    for d, m in sorted(rows.items(), key=lambda kv: ("(mean" in kv[0], kv[0]))]
            first = "dataset"
        note = f'<p class="note">{html.escape(notes[task])}</p>' if task in notes else ""
        parts.append(f'<h3 id="t-{task}">{html.escape(title)}</h3>{note}<div class="scroll"><table><thead><tr>'
                     f"<th>{first}</th>{head}</tr></thead><tbody>{''.join(body)}</tbody></table></div>")
    return "\n".join(parts)


def _skipped(skipped: dict[str, str]) -> str:
    """The tasks that have no results here, each with its reason."""
    if not skipped:
        return ""
    items = "".join(f"<li><b>{html.escape(_TASK_TITLES.get(task, task))}</b>: {html.escape(reason)}</li>"
                    for task, reason in skipped.items())
    return f'<h3 id="skipped">Skipped</h3><ul class="note">{items}</ul>'


def _headline(results: dict) -> str:
    """The cards above the sections: each task's headline metric, picked by name (nclip.eval.headline)."""
    cards = []
    for label, key in headline_picks(results):
        metric = split_key(key)[2]
        cards.append(f'<div class="card"><div class="big">{fmt(metric, results[key])}</div>'
                     f'<div class="lbl">{html.escape(label)}</div><div class="key">{html.escape(key)}</div></div>')
    return f'<div class="cards">{"".join(cards)}</div>' if cards else ""


def read_metrics(path: Path) -> list[dict]:
    """The logged steps of a run's metrics.jsonl (damaged lines skipped, as :func:`nclip.jsonio.read_jsonl`)."""
    return [row for row in read_jsonl(path) if "step" in row]


# ---------------------------------------------------------------------------------------------
# the page
# ---------------------------------------------------------------------------------------------

_CSS = """
body{font:14px/1.45 -apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;color:#1d2530;margin:0;background:#f6f7f9}
main{max-width:1180px;margin:0 auto;padding:24px 28px 60px;background:#fff;box-shadow:0 0 12px #0001}
h1{font-size:22px;margin:0 0 4px}h2{font-size:18px;margin:34px 0 10px;border-bottom:2px solid #e3e7ee;padding-bottom:4px}
h3{font-size:14px;margin:20px 0 6px;color:#34475e}
.meta{color:#566;font-size:12.5px}.meta code{background:#f1f3f6;padding:1px 4px;border-radius:3px}
nav{margin:12px 0;font-size:13px}nav a{margin-right:12px;color:#2a5db0;text-decoration:none}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:16px 0}
.card{flex:1 1 130px;border:1px solid #e1e5eb;border-radius:8px;padding:10px 12px;background:#fbfcfe}
.card .big{font-size:24px;font-weight:600;color:#1f4f9a}.card .lbl{font-size:12.5px}.card .key{font-size:10.5px;color:#889}
.scroll{overflow-x:auto}
table{border-collapse:collapse;font-size:12.5px;margin:4px 0 10px}
th,td{padding:4px 9px;border-bottom:1px solid #e8ebf0;white-space:nowrap}thead th{background:#f1f4f8;text-align:right}
thead th:first-child,th.row{text-align:left;font-weight:600}td.num{text-align:right;font-variant-numeric:tabular-nums}
tbody tr:nth-child(even){background:#fafbfc}
img.fig{max-width:100%;display:block;margin:6px 0}img.small{max-width:560px}img.tiny{max-width:440px}
.fails{display:grid;grid-template-columns:repeat(auto-fill,minmax(340px,1fr));gap:12px}
.fail{border:1px solid #e1e5eb;border-radius:8px;padding:10px}.pics{display:flex;gap:10px}
figure{margin:0;text-align:center;font-size:11px;color:#667}img.thumb{width:112px;height:112px;image-rendering:pixelated;border-radius:4px}
img.dim{opacity:.75}.tag{display:inline-block;font-size:10.5px;font-weight:600;text-transform:uppercase;border-radius:3px;padding:0 5px;margin-right:4px;color:#fff}
.bad .tag{background:#c0392b}.good .tag{background:#27864a}.fail p{margin:6px 0}.rank{color:#889;font-size:11.5px}
.note{color:#667;font-size:12.5px}details pre{background:#f4f6f8;padding:10px;font-size:11.5px;overflow-x:auto}
"""  # noqa: E501 -- the page's CSS, one line per group of rules


def render(doc: dict, artifacts: dict, ck=None) -> str:
    """The report page for a results document and the runner's artifacts."""
    import matplotlib

    # here, not above: fmt and the tables (eval compare, the CLI summary) need no torch or matplotlib
    from nclip.eval.glyphs import class_name_fonts

    matplotlib.use("Agg", force=True)

    r = doc["results"]
    sections: list[tuple[str, str, str]] = []  # (id, title, html)
    if doc.get("suite"):  # nclip eval --suite: the papers' one-row table first
        from nclip.eval.suite_table import html_table

        sections.append(("suite", f"Suite: {doc['suite']['name']}", html_table(doc["suite"])))
    sections.append(("results", "Results",
                     _tables(r, _task_notes(doc["config"])) + _skipped(doc.get("skipped", {}))))
    said: list[str] = []
    with class_name_fonts(_drawn_names(artifacts), say=said.append):
        figs = _figures(doc, artifacts)
    for line in said:  # once per report, on the terminal and above the plots it concerns
        print(f"nclip: warning: {line}", file=sys.stderr)
    if said and figs:
        sid, title, body = figs[0]
        figs[0] = (sid, title, "".join(f'<p class="note">{html.escape(line)}</p>' for line in said) + body)
    sections += figs
    config = json.dumps({"config": doc["config"], "timing": doc.get("timing"), "cache": doc.get("cache")},
                        indent=2, default=str)
    sections.append(("config", "Configuration", f"<details><summary>resolved eval config, timing, cache</summary>"
                                                f"<pre>{html.escape(config)}</pre></details>"))
    return _page(doc, sections)


def _drawn_names(artifacts: dict) -> list[str]:
    """The user's names the figures draw: datasets and classes of the confusion matrices and the
    t-SNE, realms of the realm-wise figure."""
    names = []
    for dataset, (_, classes) in artifacts.get("confusion", {}).items():
        names += [dataset, *classes]
    if artifacts.get("tsne"):
        names += list(artifacts["tsne"]["names"])
    for dataset, per in artifacts.get("realms", {}).items():
        names += [dataset, *per]
    return [str(n) for n in names]


def _figures(doc: dict, artifacts: dict) -> list[tuple[str, str, str]]:
    """The (id, title, html) sections of the figures, in page order."""
    from nclip.eval.curve_panels import curve_panels
    from nclip.eval.figures import (
        confusion_figure,
        confusion_width_px,
        curves_figure,
        failures_html,
        img_tag,
        masks_figure,
        realms_figure,
        segmentation_figure,
        tsne_figure,
    )
    from nclip.eval.settings import TSNE_ITERS

    r = doc["results"]
    c = doc["checkpoint"]
    figs = []
    conf = artifacts.get("confusion", {})
    tsne = artifacts.get("tsne")
    if conf:
        primary = f"{tsne['dataset']}-{tsne['kind']}" if tsne and f"{tsne['dataset']}-{tsne['kind']}" in conf \
            else next(iter(conf))
        cm, names = conf[primary]
        top1 = r.get(f"zeroshot/{primary}/top1")
        figs.append(("confusion", f"Zero-shot confusion matrix: {primary}",
                     f'<p class="note">Rows: true class; shading: share of the row. Top-1 = {fmt("top1", top1)}%, '
                     f'head <b>{html.escape(c["head"])}</b>.</p>'
                     + img_tag(confusion_figure(cm, names), "confusion",
                               "fig small" if confusion_width_px(len(names)) <= 560 else "fig")))
    if tsne:
        figs.append(("tsne", "t-SNE of class embeddings (App. G, Figs. G3-G6)",
                     img_tag(tsne_figure(tsne, max_iter=doc["config"].get("tsne_iters", TSNE_ITERS)), "t-SNE", "fig")))
    fails = artifacts.get("failures", {})
    if fails:
        body = '<p class="note">Images whose top-ranked caption belongs to another image, most confident ' \
               "mistakes first (cf. Fig. 5 / D2).</p>"
        body += "".join(failures_html(name, *v) for name, v in fails.items())
        figs.append(("failures", "Retrieval failure cases (image → text)", body))
    for name, m in artifacts.get("masks", {}).items():
        figs.append((f"masks-{name}", f"Mask probing: {name}",
                     f'<p class="note">Best head {m["best_head"]}: '
                     f'Jaccard {fmt("jaccard", r.get(f"masks/{name}/jaccard"))}% '
                     "over the probed scenes.</p>" + img_tag(masks_figure(name, m), "mask probing", "fig")))
    for name, m in artifacts.get("segmentation", {}).items():
        figs.append((f"segmentation-{name}", f"Zero-shot segmentation: {name}",
                     f'<p class="note">mIoU {fmt("miou", r.get(f"segmentation/{name}/miou"))}%, '
                     f'mAcc {fmt("macc", r.get(f"segmentation/{name}/macc"))}% over the segmented scenes.</p>'
                     + img_tag(segmentation_figure(name, m), "zero-shot segmentation", "fig")))
    base = artifacts.get("baseline")
    for name, per in artifacts.get("realms", {}).items():
        if per:
            note = f'<p class="note">Baseline: {html.escape(base["source"])}</p>' if base else ""
            figure = realms_figure(per, base["results"] if base else None, name)
            figs.append((f"realms-{name}", f"Realm-wise probing: {name}", note + img_tag(figure, "realms", "fig tiny")))
    run_dir = Path(c["run_dir"]) if c.get("run_dir") else None
    if run_dir and (run_dir / "metrics.jsonl").is_file():
        rows = read_metrics(run_dir / "metrics.jsonl")
        panels, zero = curve_panels(rows)
        if panels:
            unchanged = f" Zero at every logged step, not drawn: {', '.join(zero)}." if zero else ""
            figs.append(("curves", "Training curves",
                         f'<p class="note">From {html.escape(str(run_dir / "metrics.jsonl"))} '
                         f"({len(rows)} logged steps).{html.escape(unchanged)}</p>"
                         + img_tag(curves_figure(rows, panels), "training curves", "fig")))
    return figs


def _page(doc: dict, sections: list[tuple[str, str, str]]) -> str:
    """The whole page: header, navigation, headline numbers and the (id, title, html) sections."""
    c = doc["checkpoint"]
    nav = "".join(f'<a href="#{sid}">{html.escape(title.split(":")[0].split(" (")[0])}</a>'
                  for sid, title, _ in sections)
    body = "".join(f'<section id="{sid}"><h2>{html.escape(title)}</h2>{content}</section>'
                   for sid, title, content in sections)
    hits, misses = len(doc.get("cache", {}).get("hits", [])), len(doc.get("cache", {}).get("misses", []))
    total = doc.get("timing", {}).get("total_s")
    meta = (f'checkpoint <code>{html.escape(c["path"])}</code> · objective <b>{html.escape(c["objective"])}</b> · '
            f'heads {html.escape(", ".join(c["heads"]))} · zero-shot head <b>{html.escape(c["head"])}</b> · '
            f'image tower <b>{html.escape(str(c.get("vision_tower", "?")))}</b> · '
            f'text tower <b>{html.escape(str(c.get("text_tower", "?")))}</b> · '
            f'trained <b>{c.get("train_steps", "?")}</b> steps · '
            f'weights sha256 <code>{c["weights_sha256"][:12]}</code> · '
            f"feature cache {hits} hit{'s' * (hits != 1)} / {misses} miss{'es' * (misses != 1)}"
            + (f" · evaluated in {total:.0f} s" if total else ""))
    return (f"<!doctype html><html lang=en><head><meta charset=utf-8>"
            f"<title>nclip eval: {html.escape(c['path'])}</title>"
            f"<meta name=viewport content='width=device-width,initial-scale=1'><style>{_CSS}</style></head><body><main>"
            f"<h1>nclip evaluation</h1><div class=meta>{meta}</div><nav>{nav}</nav>{_headline(doc['results'])}{body}"
            f'<p class="note">Percentages unless noted; STS is Spearman x 100; "relative" is accuracy minus the '
            f"baseline's, in points.</p></main></body></html>")
