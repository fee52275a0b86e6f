"""The verdict rule of docs/reproduction.md as code, so that a test can recompute every stated verdict
from the cells it rests on.

A doc holds two kinds of markdown tables:

* measured tables, each introduced by a tag ``<!-- table: NAME; key: COL, COL; ... -->`` on the line
  above it. Its score cells read "X ± h" (two seeds: the mean and half their range), "X [min, max]"
  (the mean and the seeds' range), "X (both seeds)" (the seeds agree) or a bare "X" (no spread).
  Tag options: ``key`` (the columns that name a row; the first by default), ``sweeps by: COL`` (rows
  are one sweep only where COL agrees; the whole table otherwise), ``another commit: ROW, ROW`` (rows
  that share no commit with the others) and ``centre ± half of N seeds`` (the "X ± h" cells give the
  centre of N seeds' range, not their mean).
* verdict tables, with the header ``| claim | score | table | order tested | verdict |``. "order
  tested" is the order the claim predicts, higher first: ``A > B, C`` (A above each of B and C),
  chains ``A < B < C``, ties ``A = B``; a row is its key, in parentheses where it holds a comma, and
  ``NAME:row`` takes it from another measured table. A "status: OUTCOME or OUTCOME" score asks that
  the listed rows end with that outcome. The verdict may carry a note: ``(saturated)`` or
  ``(confound: ...)``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

VERDICT_HEADER = ["claim", "score", "table", "order tested", "verdict"]
# weakest first: a statement made of several comparisons is as strong as its weakest one
ORDERING_VERDICTS = ["not reproduced", "inconclusive", "direction only", "reproduced"]
TIE_VERDICTS = ["not reproduced", "inconclusive", "no difference found"]
SATURATED_AT = 95.0  # percent: rows whose every seed scores this high have no room left to be ranked
NUM = r"-?\d+(?:\.\d+)?"


class RuleError(ValueError):
    """A verdict table the rule cannot read or decide."""


@dataclass(frozen=True)
class Figure:
    """A score over the seeds: their range [lo, hi], and the interval the mean is known to lie in
    (a point where the cell gives the mean)."""

    lo: float
    hi: float
    mean_lo: float
    mean_hi: float
    spread: bool = True


def parse_figure(cell: str, centre_of: int | None = None) -> Figure | None:
    """The figure a score cell holds, or None for a cell that holds none ("–", a status)."""
    cell = cell.strip()
    if m := re.fullmatch(rf"({NUM}) ± ({NUM})", cell):
        x, h = float(m[1]), float(m[2])
        lo, hi = round(x - h, 6), round(x + h, 6)
        if centre_of:  # N seeds with min lo and max hi: the third one lies between them
            return Figure(lo, hi, round(lo + (hi - lo) / centre_of, 6), round(hi - (hi - lo) / centre_of, 6))
        return Figure(lo, hi, x, x)
    if m := re.fullmatch(rf"({NUM}) \[({NUM}), ({NUM})\]", cell):
        return Figure(float(m[2]), float(m[3]), float(m[1]), float(m[1]))
    if m := re.fullmatch(rf"({NUM}) \(both seeds\)", cell):
        x = float(m[1])
        return Figure(x, x, x, x)
    if re.fullmatch(NUM, cell):
        x = float(cell)
        return Figure(x, x, x, x, spread=False)
    return None


def split_top(text: str, sep: str) -> list[str]:
    """``text`` split at each ``sep`` outside parentheses, the parts stripped."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(text):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
        elif depth == 0 and text.startswith(sep, i):
            parts.append(text[start:i].strip())
            start = i = i + len(sep)
            continue
        i += 1
    parts.append(text[start:].strip())
    return parts


def _unwrap(ref: str) -> str:
    """``(a, b)`` → ``a, b`` where one pair of parentheses encloses the whole reference."""
    ref = ref.strip()
    if not (ref.startswith("(") and ref.endswith(")")):
        return ref
    depth = 0
    for i, ch in enumerate(ref):
        depth += (ch == "(") - (ch == ")")
        if depth == 0 and i < len(ref) - 1:
            return ref  # "(a) b (c)": the first pair closes early
    return ref[1:-1].strip()


def _key_text(cell: str) -> str:
    return cell.strip().replace("`", "").removeprefix("- ").strip()


@dataclass
class Table:
    """A markdown table: its header, its rows of cells, the tag above it and its line number."""

    header: list[str]
    rows: list[list[str]]
    tag: dict[str, str]
    line: int


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def read_tables(text: str) -> list[Table]:
    tables, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if not lines[i].startswith("|"):
            i += 1
            continue
        start = i
        while i < len(lines) and lines[i].startswith("|"):
            i += 1
        above = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        tag = {}
        if m := re.fullmatch(r"<!--\s*(table:.*?)\s*-->", above):
            for part in split_top(m[1], ";"):
                name, _, value = part.partition(":")
                tag[name.strip()] = value.strip()
        tables.append(Table(_cells(lines[start]), [_cells(row) for row in lines[start + 2:i]], tag, start + 1))
    return tables


TAG_OPTIONS = {"table", "key", "sweeps by", "another commit"}


def _split_column(header: str, cells: list[str]) -> list[str] | None:
    """The score names of a column that holds two scores per cell ("mIoU / mAcc, threshold 0" over
    "0.23 ± 0.08 / 6.09 ± 0.13": "mIoU (threshold 0)" and "mAcc (threshold 0)"), else None."""
    if " / " not in header or not all(" / " in cell for cell in cells):
        return None
    names, _, qualifier = header.partition(", ")
    return [f"{name.strip()} ({qualifier})" if qualifier else name.strip() for name in names.split(" / ")]


@dataclass
class Measured:
    """A measured table: each row's cells by score name, and which sweep each row came from."""

    name: str
    cells: dict[str, dict[str, str]]  # row key -> score name -> cell
    sweep_of: dict[str, str]  # row key -> the sweep it was trained in
    apart: set[str] = field(default_factory=set)  # rows that share no commit with the others
    centre_of: int | None = None
    scores: list[str] = field(default_factory=list)

    @classmethod
    def from_table(cls, table: Table) -> Measured:
        tag, header = table.tag, table.header
        centre = [k for k in tag if re.fullmatch(r"centre ± half of \d+ seeds", k)]
        if set(tag) - TAG_OPTIONS - set(centre):
            raise RuleError(f"table {tag['table']}: unknown tag options {sorted(set(tag) - TAG_OPTIONS - set(centre))}")
        try:
            key_cols = [header.index(c) for c in split_top(tag.get("key", header[0]), ",")]
            by = header.index(tag["sweeps by"]) if "sweeps by" in tag else None
        except ValueError:
            raise RuleError(f"table {tag['table']}: its tag names a column it lacks") from None
        apart = {_unwrap(r) for r in split_top(tag.get("another commit", ""), ",") if r}
        measured = cls(tag["table"], {}, {}, apart, int(re.findall(r"\d+", centre[0])[0]) if centre else None)
        columns = []  # (column, the score names it holds, split at " / ")
        for col, head in enumerate(header):
            if col not in key_cols:
                split = _split_column(head, [row[col] for row in table.rows])
                columns.append((col, split or [head], bool(split)))
                measured.scores += split or [head]
        for row in table.rows:
            key = ", ".join(_key_text(row[c]) for c in key_cols)
            if key in measured.cells:
                raise RuleError(f"table {measured.name}: two rows named {key!r}")
            measured.cells[key] = {}
            for col, names, split in columns:
                cell, both = row[col], row[col].endswith(" (both seeds)")
                bare = cell.removesuffix(" (both seeds)")
                parts = bare.split(" / ") if split else [bare]
                if len(parts) != len(names):
                    raise RuleError(f"table {measured.name}, row {key!r}: {cell!r} does not hold {names}")
                for name, part in zip(names, parts):
                    measured.cells[key][name] = part + (" (both seeds)" if both else "")
            measured.sweep_of[key] = "" if by is None else _key_text(row[by])
        if apart - set(measured.cells):
            raise RuleError(f"table {measured.name} has no rows {sorted(apart - set(measured.cells))}")
        return measured

    def score_name(self, score: str) -> str:
        if score in self.scores:
            return score
        bare = [s for s in self.scores if re.sub(r" \(.*\)$", "", s) == score]
        if len(bare) != 1:
            raise RuleError(f"table {self.name} has no score {score!r} (it has {self.scores})")
        return bare[0]

    def score_list(self, cell: str) -> list[str]:
        """The scores a verdict line names, comma-separated; a name may hold a comma itself
        ("linear, 10 digits"), so the longest name that starts the rest is taken first."""
        names = sorted(set(self.scores) | {re.sub(r" \(.*\)$", "", s) for s in self.scores}, key=len, reverse=True)
        out, rest = [], cell.strip()
        while rest:
            name = next((n for n in names if rest == n or rest.startswith(n + ", ")), None)
            if name is None:
                raise RuleError(f"table {self.name} has no score {rest!r} (it has {self.scores})")
            out.append(self.score_name(name))
            rest = rest[len(name):].removeprefix(",").strip()
        return out

    def row(self, ref: str) -> str:
        """The row a reference names: its key, or the one key that adds a parenthesised note to it
        ("xCLIP" for "xCLIP (λ_CLIP 1, λ_nCLIP 0.2)")."""
        key = _unwrap(ref)
        if key in self.cells:
            return key
        noted = [k for k in self.cells if k.startswith(key + " (")]
        if len(noted) != 1:
            raise RuleError(f"table {self.name} has no row {ref!r} (it has {list(self.cells)})")
        return noted[0]

    def figure(self, key: str, score: str) -> Figure:
        cell = self.cells[key][self.score_name(score)]
        figure = parse_figure(cell, self.centre_of)
        if figure is None:
            raise RuleError(f"table {self.name}, row {key!r}: {score!r} holds no figure ({cell!r})")
        return figure


def compare(high: Figure, low: Figure, one_commit: bool) -> str:
    """The verdict on "``high`` above ``low``" by the rule."""
    if not (high.spread and low.spread):
        return "inconclusive"  # a figure the verdict needs has no seed spread
    if high.lo > low.hi:
        return "reproduced" if one_commit else "direction only"
    if high.hi < low.lo:
        return "not reproduced"
    if high.mean_lo > low.mean_hi:
        return "direction only"
    # against the paper in the means, level, or means the cells do not fix (centres of three seeds)
    return "inconclusive"


def level(a: Figure, b: Figure) -> str:
    """The verdict on "``a`` level with ``b``" (a tie the paper reports)."""
    if not (a.spread and b.spread):
        return "inconclusive"
    if a.lo > b.hi or a.hi < b.lo:
        return "not reproduced"
    return "no difference found"


def outcome(cell: str, outcomes: list[str]) -> str:
    """The verdict on "every run of this row ends in one of ``outcomes``", from a status cell such as
    "dimensional collapse (3 of 3)" or "ok"."""
    statuses = [re.sub(r" \(\d+ of \d+\)$", "", part) for part in split_top(cell, ",")]
    hits = [s in outcomes for s in statuses]
    return "reproduced" if all(hits) else "not reproduced" if not any(hits) else "inconclusive"


def weakest(verdicts: list[str], scale: list[str]) -> str:
    return min(verdicts, key=scale.index)


@dataclass
class Verdict:
    """One row of a verdict table, as stated and as the rule computes it."""

    line: int
    claim: str
    stated: str
    computed: str
    figures: list[Figure] = field(default_factory=list)


def _resolve(ref: str, default: Measured, tables: dict[str, Measured]) -> tuple[Measured, str]:
    if (m := re.fullmatch(r"([\w.-]+):\s*(.+)", ref.strip())) and m[1] in tables:
        return tables[m[1]], tables[m[1]].row(m[2])
    return default, default.row(ref)


def _one_commit(a: tuple[Measured, str], b: tuple[Measured, str]) -> bool:
    (ta, ka), (tb, kb) = a, b
    return ta is tb and ta.sweep_of[ka] == ta.sweep_of[kb] and not {ka, kb} & ta.apart


def _parse_order(order: str) -> tuple[str, list[list[str]]]:
    """The operator of an "order tested" cell and its groups of row references, higher first."""
    found = [op for op in (" = ", " > ", " < ") if len(split_top(order, op)) > 1]
    if len(found) != 1:
        raise RuleError(f"order tested {order!r} " + ("mixes its operators" if found else "holds no '>', '<' or '='"))
    groups = [split_top(group, ",") for group in split_top(order, found[0])]
    return found[0], groups[::-1] if found[0] == " < " else groups


def _computed(row: dict[str, str], tables: dict[str, Measured]) -> tuple[str, list[Figure]]:
    """The verdict the rule gives a verdict table's line, and the figures it compared."""
    if row["table"] not in tables:
        raise RuleError(f"no measured table named {row['table']!r}")
    default = tables[row["table"]]
    if row["score"].startswith("status:"):
        outcomes = [o.strip() for o in row["score"].removeprefix("status:").split(" or ")]
        rows = [_resolve(r, default, tables) for r in split_top(row["order tested"], ",")]
        return weakest([outcome(t.cells[k][t.score_name("status")], outcomes) for t, k in rows],
                       ORDERING_VERDICTS), []
    op, groups = _parse_order(row["order tested"])
    rows = [[_resolve(r, default, tables) for r in group] for group in groups]
    pairs = [(a, b) for upper, lower in zip(rows, rows[1:]) for a in upper for b in lower]
    found, figures = [], []
    for score in default.score_list(row["score"]):
        for a, b in pairs:
            fa, fb = a[0].figure(a[1], score), b[0].figure(b[1], score)
            figures += [fa, fb]
            found.append(level(fa, fb) if op == " = " else compare(fa, fb, _one_commit(a, b)))
    return weakest(found, TIE_VERDICTS if op == " = " else ORDERING_VERDICTS), figures


def _stated(cell: str) -> tuple[str, str]:
    """(verdict, note) of a verdict cell such as "**inconclusive** (saturated)"."""
    text = cell.replace("*", "").strip()
    m = re.fullmatch(r"([a-z ]+?)\s*(?:\((.*)\))?", text)
    if not m or m[1] not in ORDERING_VERDICTS + TIE_VERDICTS:
        raise RuleError(f"{cell!r} is no verdict of the rule")
    return m[1], (m[2] or "").strip()


def _measured(tables: list[Table]) -> dict[str, Measured]:
    measured = {}
    for table in tables:
        if "table" in table.tag:
            if table.tag["table"] in measured:
                raise RuleError(f"two measured tables named {table.tag['table']!r}")
            measured[table.tag["table"]] = Measured.from_table(table)
    return measured


def _verdict_lines(tables: list[Table]):
    """(line number, cells by header name) of every row of the verdict tables."""
    for table in tables:
        if [h.lower() for h in table.header] == VERDICT_HEADER:
            for i, cells in enumerate(table.rows):
                yield table.line + 2 + i, dict(zip(VERDICT_HEADER, cells, strict=True))


def verdicts(text: str) -> list[Verdict]:
    """Every row of the doc's verdict tables with the verdict the rule computes from its cells."""
    tables = read_tables(text)
    measured, out = _measured(tables), []
    for line, row in _verdict_lines(tables):
        try:
            computed, figures = _computed(row, measured)
            stated, note = _stated(row["verdict"])
        except RuleError as e:
            raise RuleError(f"line {line}: {e}") from None
        if note == "saturated":
            if not figures or min(f.lo for f in figures) < SATURATED_AT:
                raise RuleError(f"line {line}: 'saturated', but a compared seed scores below {SATURATED_AT} %")
            computed = "inconclusive"
        elif note.startswith("confound:") and note.removeprefix("confound:").strip():
            computed = "inconclusive"  # the rule's "a confound stands", named where it is claimed
        out.append(Verdict(line, row["claim"], stated, computed, figures))
    return out


def unjudged_scores(text: str) -> dict[str, set[str]]:
    """For every measured table of the doc: its scores with seed spreads that no verdict row judges
    (an empty set when every one has its verdict)."""
    tables = read_tables(text)
    measured = _measured(tables)
    judged: dict[str, set[str]] = {name: set() for name in measured}
    for _, row in _verdict_lines(tables):
        if row["score"].startswith("status:"):
            continue
        named = ({row["table"]} | set(re.findall(r"([\w.-]+):", row["order tested"]))) & set(measured)
        for name in named:
            judged[name].update(measured[name].score_list(row["score"]))
    missing = {}
    for name, t in measured.items():
        spread = {s for s in t.scores if any((f := parse_figure(c.get(s, ""), t.centre_of)) and f.spread
                                             for c in t.cells.values())}
        missing[name] = spread - judged[name]
    return missing


def untagged_tables(text: str) -> list[int]:
    """Line numbers of tables whose cells carry seed spreads but no tag names them."""
    return [t.line for t in read_tables(text) if "table" not in t.tag
            and [h.lower() for h in t.header] != VERDICT_HEADER
            and any((f := parse_figure(c)) and f.spread for row in t.rows for c in row)]
