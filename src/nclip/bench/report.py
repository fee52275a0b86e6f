"""The bench's rows and the table it prints (:mod:`nclip.bench.runner` fills them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Row:
    what: str
    value: float | None  # None: skipped (the detail says why)
    detail: str = ""
    wall_s: float | None = None  # the wall time of the stage that measured it


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    details: dict = field(default_factory=dict)

    def add(self, what: str, value: float, detail: str = "") -> None:
        self.rows.append(Row(what, float(value), detail))

    def skip(self, what: str, reason: str) -> None:
        self.rows.append(Row(what, None, reason))

    def table(self) -> str:
        width = max(len(r.what) for r in self.rows)
        lines = [f"{'row':<{width}}  {'value':>10}  {'wall s':>7}  detail"]
        lines += [f"{r.what:<{width}}  {_fmt(r.value):>10}  {_fmt_s(r.wall_s):>7}  {r.detail}" for r in self.rows]
        return "\n".join(lines)


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
        return f"{v:.3g}"
    return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"


def _fmt_s(s: float | None) -> str:
    return "" if s is None else f"{s:.1f}"
