"""A suite's table, as papers print a zero-shot suite (CLIP Tab. 11, xCLIP Tab. 1): one row per
model, one column per dataset and task with its headline number, and the mean of the row.

Headline numbers (percentages): zero-shot, linear and k-NN top-1 (of the dataset's class labels:
kind ``class``, else its first kind), retrieval R@1 as the mean of image→text and text→image R@1
(CLIP_benchmark's and DataComp's average), multi-label mAP. The ``suite`` section of results.json
(:func:`suite_section`) holds the cells and the means: over all cells (``all``) and per task. A
cell without a value (the task was skipped) is left out of the means, and the table says so.

Importable without torch: ``nclip eval compare`` and the report use it.
"""

from __future__ import annotations

import html

# task -> (column label, metric(s) of the result keys averaged into the cell)
HEADLINE = {
    "zeroshot": ("zero-shot top-1", ("top1",)),
    "linear": ("linear top-1", ("top1",)),
    "knn": ("k-NN top-1", ("top1",)),
    "retrieval": ("R@1 (I→T, T→I mean)", ("i2t@1", "t2i@1")),
    "multilabel": ("mAP", ("mAP",)),
}
_CLASS_TASKS = ("zeroshot", "linear", "knn", "multilabel")


def _cell_keys(task: str, dataset: str, results: dict) -> list[str]:
    """The result keys averaged into the (task, dataset) cell ([] when the task has no results)."""
    metrics = HEADLINE[task][1]
    if task not in _CLASS_TASKS:
        keys = [f"{task}/{dataset}/{m}" for m in metrics]
        return keys if all(k in results for k in keys) else []
    kinds = sorted({k.split("/")[1] for k in results
                    if k.startswith(f"{task}/{dataset}-") and k.endswith(f"/{metrics[0]}")})
    if not kinds:
        return []
    kind = f"{dataset}-class" if f"{dataset}-class" in kinds else kinds[0]
    return [f"{task}/{kind}/{metrics[0]}"]


def suite_section(name: str, file: str, entries: list[dict], results: dict) -> dict:
    """The ``suite`` section of results.json: ``entries`` (spec, tasks, datasets, prompts), the
    headline ``cells`` in suite order and their ``mean`` (``all`` and per task)."""
    cells = []
    for entry in entries:
        for dataset in entry["datasets"]:
            for task in entry["tasks"]:
                if task not in HEADLINE:
                    continue
                keys = _cell_keys(task, dataset, results)
                value = sum(results[k] for k in keys) / len(keys) if keys else None
                cells.append({"dataset": dataset, "task": task, "label": HEADLINE[task][0], "keys": keys,
                              "value": value})
    return {"name": name, "file": file, "datasets": entries, "cells": cells, "mean": means(cells)}


def means(cells: list[dict]) -> dict:
    """{"all": mean of every cell with a value, task: mean of its cells, "cells": (used, total)}."""
    def mean(values):
        return sum(values) / len(values) if values else None

    have = [c for c in cells if c["value"] is not None]
    out = {"all": mean([c["value"] for c in have]), "cells": [len(have), len(cells)]}
    for task in dict.fromkeys(c["task"] for c in cells):
        out[task] = mean([c["value"] for c in have if c["task"] == task])
    return out


def _columns(sections: list[dict]) -> list[tuple[str, str, str]]:
    """(dataset, task, header) of every cell of the sections, in the first section's order."""
    cols: dict[tuple[str, str], str] = {}
    for section in sections:
        for c in section["cells"]:
            cols.setdefault((c["dataset"], c["task"]), f"{c['dataset']} {c['label']}")
    return [(d, t, h) for (d, t), h in cols.items()]


def _pct(value, base=None) -> str:
    if value is None:
        return "–"
    text = f"{100 * value:.1f}"
    return text if base is None else f"{text} ({100 * (value - base):+.1f})"


def table_rows(sections: list[dict]) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the suite table of one or more runs' sections (rows after the first show
    their difference to it in points); the Mean is over the cells each row has."""
    cols = _columns(sections)
    tasks = list(dict.fromkeys(t for _, t, _ in cols))
    head = [h for _, _, h in cols] + ["Mean"] + ([f"Mean {HEADLINE[t][0]}" for t in tasks] if len(tasks) > 1 else [])
    rows, first = [], sections[0]["mean"]
    for i, section in enumerate(sections):
        value = {(c["dataset"], c["task"]): c["value"] for c in section["cells"]}
        base = {(c["dataset"], c["task"]): c["value"] for c in sections[0]["cells"]} if i else {}
        row = [_pct(value.get((d, t)), base.get((d, t)) if i else None) for d, t, _ in cols]
        m = section["mean"]
        used, total = m.get("cells", [0, 0])
        partial = "" if used == total else f" ({used}/{total})"  # cells without a value are left out
        row.append(_pct(m.get("all"), first.get("all") if i else None) + partial)
        if len(tasks) > 1:
            row += [_pct(m.get(t), first.get(t) if i else None) for t in tasks]
        rows.append(row)
    return head, rows


def markdown(sections: list[dict], names: list[str]) -> list[str]:
    """The suite table as markdown lines (``nclip eval compare``)."""
    head, rows = table_rows(sections)
    title = " / ".join(dict.fromkeys(s["name"] for s in sections))
    lines = ["", f"## Suite: {title}", "", "| run | " + " | ".join(head) + " |",
             "|:---|" + "|".join(["---:"] * len(head)) + "|"]
    lines += ["| " + " | ".join([n, *r]) + " |" for n, r in zip(names, rows)]
    return lines


def html_table(section: dict) -> str:
    """The suite table of one run, for report.html."""
    head, rows = table_rows([section])
    specs = "".join(f"<li><code>{html.escape(e['spec'])}</code>: {html.escape(', '.join(e['tasks']))}</li>"
                    for e in section["datasets"])
    return (f'<p class="note">Suite <b>{html.escape(section["name"])}</b> (<code>{html.escape(section["file"])}'
            f"</code>): headline numbers in percent; R@1 is the mean of image→text and text→image R@1.</p>"
            f'<div class="scroll"><table><thead><tr>' + "".join(f"<th>{html.escape(h)}</th>" for h in head)
            + "</tr></thead><tbody>" + "".join("<tr>" + "".join(f'<td class="num">{html.escape(v)}</td>' for v in r)
                                               + "</tr>" for r in rows)
            + f'</tbody></table></div><ul class="note">{specs}</ul>')
