"""The sweep's results as tables: one row per run (:func:`collect`), written as DIR/table.md in the
layout of xCLIP Tab. 9 and as DIR/table.csv with the unrounded and measured numbers."""

from __future__ import annotations

import csv
import math
import shlex
from pathlib import Path

from nclip.jsonio import read_json
from nclip.objectives import plan_for
from nclip.objectives.registry import registered_configs
from nclip.sweep.grid import RunSpec, format_value, short_names
from nclip.sweep.options import SweepOptions
from nclip.sweep.probe import probe_dataset
from nclip.sweep.verdicts import STATUS_TEXT, TERM_KEYS, finite, judge, read_metrics, stderr_tail


def field_title(key: str) -> str | None:
    """The symbol of a config key in the papers (its field's ``title``: λ1, τ_s, dim, ...), if it has one.
    An ``objective.*`` key is looked up in every registered objective's config."""
    from nclip.config import RunConfig

    *path, name = key.split(".")
    if path == ["objective"]:
        configs = list(registered_configs())
    else:
        section = RunConfig
        for part in path:
            info = section.model_fields.get(part)
            section = info.annotation if info is not None else None
            if not isinstance(section, type):
                return None
        configs = [section]
    titles = [c.model_fields[name].title for c in configs if name in getattr(c, "model_fields", {})]
    return next((t for t in titles if t), None)


def collect(out: Path, runs: list[RunSpec], configs: dict, journal=None) -> list[dict]:
    """One row per run: its values, ZS, LN, final terms, verdict and curves. ``journal`` (the
    sweep's, with ``run(slug)`` → its sweep.json entry) gives each run's status; without it every
    run reads as pending."""
    rows = []
    for run in runs:
        rd = out / "runs" / run.slug
        entry = journal.run(run.slug) if journal else {}
        cfg = configs[run.slug]
        metrics = read_metrics(rd / "metrics.jsonl")
        status = entry.get("status", "pending")
        stderr = stderr_tail(rd / "error.txt") if status in ("failed", "diverged") else ""
        v = judge(metrics, cfg, stderr if entry.get("stage") == "train" else "")
        dataset, kind = probe_dataset(cfg)
        zs = ln = math.nan
        if (rd / "eval.json").is_file():
            zs = float(read_json(rd / "eval.json").get(f"zeroshot/{kind}/top1", math.nan))
        if (rd / "probe.json").is_file():
            ln = float(read_json(rd / "probe.json").get("linear/top1", math.nan))
        if status == "done":
            state = STATUS_TEXT[v["verdict"]]
        elif status == "diverged" or v["verdict"] == "diverged":
            state = "diverged"
        else:
            state = status  # failed, pending, running (interrupted)
        bad = state not in ("ok", "dimensional collapse")
        rows.append({
            "slug": run.slug, "name": run.name, "values": run.values, "state": state,
            "zs_measured": zs, "ln_measured": ln,
            "zs": math.nan if bad else zs, "ln": math.nan if bad else ln,
            "final": v["final"], "collapse": v["collapse"], "nonfinite_steps": v["nonfinite_steps"],
            "wall_s": entry.get("wall_s"), "error": entry.get("error", ""), "metrics": metrics,
            "zs_key": f"zeroshot/{kind}/top1", "ln_data": f"{dataset}-{kind}", "k": cfg.model.nclip_dim,
            "stats_prefix": getattr(plan_for(cfg).collapse_watch, "prefix", None),
        })
    return rows


def _pct(x: float) -> str:
    return f"{100 * x:.1f}" if finite(x) else "NaN"


def _num(x) -> str:
    return f"{x:.3f}" if finite(x) else ("NaN" if x is not None else "–")


def _csvnum(x) -> str:
    if x is None:
        return ""
    return "NaN" if not finite(x) else f"{x:.6g}"


def _cell(row: dict, key: str) -> str:
    s = row["state"]
    if s.startswith("collapsed"):
        return "collapsed"
    if s != "diverged" and s not in ("ok", "dimensional collapse"):
        return s  # failed, pending, interrupted
    return _pct(row[key])


def write_table(out: Path, rows: list[dict], runs: list[RunSpec], opts: SweepOptions, doc: dict) -> None:
    """DIR/table.md (the layout of Tab. 9: varied keys, ZS, LN; plus the final L_KL/L_EH/L_HE
    and the verdict) and DIR/table.csv (the same, unrounded, with the measured numbers)."""
    keys = list(runs[0].values) if runs else []
    shorts = short_names(keys)
    named = any(r.name for r in runs)
    head = (["setting"] if named else []) + [field_title(k) or shorts[k] for k in keys] + \
        ["ZS", "LN", "L_KL", "L_EH", "L_HE", "status"]
    align = ([":--"] if named else []) + ["--:"] * (len(keys) + 5) + [":--"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    for r in rows:
        f = r["final"]
        cells = ([r["name"] or ""] if named else []) + [format_value(r["values"].get(k)) for k in keys] + \
            [_cell(r, "zs"), _cell(r, "ln"), _num(f.get("L_KL")), _num(f.get("L_EH")), _num(f.get("L_HE")), r["state"]]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    ex = rows[0] if rows else {"zs_key": "zeroshot/shape/top1", "ln_data": "synthetic-shape"}
    over = " ".join(f"--set {shlex.quote(o)}" for o in opts.overrides)
    notes = [
        f"Sweep of `--preset {opts.preset}`{(' ' + over) if over else ''}: {len(rows)} runs "
        f"({doc.get('parallel')} at once × {doc.get('threads_per_run')} thread"
        f"{'s' * (doc.get('threads_per_run') != 1)} each).",
        "",
        *lines,
        "",
        f"ZS: zero-shot top-1 (%) of the objective's zero-shot head on held-out {ex['ln_data'].split('-')[0]} images "
        f"(`{ex['zs_key']}` of RUN/eval.json). LN: linear-probe top-1 (%) on frozen image-backbone features "
        f"({ex['ln_data']}, {opts.probe_train} train / {opts.probe_test} test held-out images, RUN/probe.json). "
        f"L_KL, L_EH, L_HE: last logged values (nats). NaN: diverged (non-finite loss); collapsed: "
        f"CollapseMonitor still reports uniform or one-hot collapse at the end of training "
        f"(measured numbers in table.csv).",
    ]
    (out / "table.md").write_text("\n".join(notes) + "\n")
    _write_csv(out / "table.csv", rows, keys)


def _write_csv(path: Path, rows: list[dict], keys: list[str]) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["slug", "setting", *keys, "zs_top1", "ln_top1", *TERM_KEYS, "status", "collapse",
                    "nonfinite_steps", "zs_measured", "ln_measured", "wall_s", "error"])
        for r in rows:
            f = r["final"]
            w.writerow([r["slug"], r["name"] or "", *[format_value(r["values"].get(k)) for k in keys],
                        _csvnum(100 * r["zs"]), _csvnum(100 * r["ln"]), *[_csvnum(f.get(k)) for k in TERM_KEYS],
                        r["state"], ";".join(r["collapse"]), r["nonfinite_steps"],
                        _csvnum(100 * r["zs_measured"]), _csvnum(100 * r["ln_measured"]),
                        _csvnum(r["wall_s"]), r["error"]])
