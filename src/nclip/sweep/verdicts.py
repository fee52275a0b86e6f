"""The verdict of a run from its files: ok, dimensional collapse, uniform or one-hot collapse
(the collapse states of xCLIP Appendix B.1), or diverged (the "NaN" rows of Tab. 9a / Tab. A1)."""

from __future__ import annotations

import math
from pathlib import Path

from nclip.jsonio import read_jsonl

TERM_KEYS = ("L_KL", "L_EH", "L_HE", "row_std", "col_std", "logit_row_std", "logit_col_std", "usage")
# a verdict of judge() as the table writes it
STATUS_TEXT = {"ok": "ok", "dimensional": "dimensional collapse", "uniform": "collapsed (uniform)",
               "one_hot": "collapsed (one-hot)", "diverged": "diverged"}


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def read_metrics(path: Path) -> list[dict]:
    """The logged steps of a run's metrics.jsonl (none if it has none yet; damaged lines skipped)."""
    return [row for row in read_jsonl(path) if "step" in row]


def stderr_tail(path: Path, lines: int = 40) -> str:
    """The last lines of a run's stderr (or error.txt): what RUN/error.txt keeps, and where
    :func:`judge` looks for the trainer's stop on non-finite losses."""
    if not path.is_file():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def judge(rows: list[dict], cfg, stderr: str = "") -> dict:
    """Verdict of a run from its logged metrics (and the trainer's stderr when it failed).

    Returns {"verdict": ok | dimensional | uniform | one_hot | diverged, "collapse": [kinds active
    at the end], "warned": {kind: step}, "final": {L_KL, ..., loss, step}, "nonfinite_steps": n}.
    """
    from nclip.train.monitors import CollapseMonitor

    final: dict[str, float] = {}
    out = {"verdict": "ok", "collapse": [], "warned": {}, "final": final, "nonfinite_steps": 0}
    if not rows:
        if "non-finite" in stderr:
            out["verdict"] = "diverged"
        return out
    last = rows[-1]
    monitor = CollapseMonitor.for_run(cfg)
    prefix = monitor.prefix if monitor is not None and f"{monitor.prefix}/L_HE" in last else None
    final["step"] = last.get("step")
    final["loss"] = last.get("loss")
    if prefix:
        for k in TERM_KEYS:
            final[k] = last.get(f"{prefix}/{k}")
        for row in rows:
            monitor.update(int(row["step"]), row)
        out["collapse"] = sorted(monitor.active)
        out["warned"] = dict(monitor.warned)
    out["nonfinite_steps"] = int(last.get("nonfinite_steps", 0) or 0)
    watched = [final.get("loss")] + [final.get(k) for k in ("L_KL", "L_EH", "L_HE") if prefix]
    if "non-finite" in stderr or any(v is not None and not finite(v) for v in watched):
        out["verdict"] = "diverged"
    elif "uniform" in out["collapse"]:
        out["verdict"] = "uniform"
    elif "one_hot" in out["collapse"]:
        out["verdict"] = "one_hot"
    elif "dimensional" in out["collapse"]:
        out["verdict"] = "dimensional"
    return out
