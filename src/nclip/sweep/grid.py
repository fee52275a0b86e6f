"""The runs of a sweep: ``--grid`` strings and grid files parsed, named settings of the paper's
tables, and their expansion into runs (overrides, table columns, directory slugs)."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from nclip.errors import NclipError
from nclip.jsonio import parse_yaml, read_text

# ---------------------------------------------------------------------------------------------
# built-in tables
# ---------------------------------------------------------------------------------------------


TABLES = ("a1", "9a", "9c", "9d", "9e", "9f")

# Tab. 9c's bottleneck width: DINO's (its head: MLP → 256-d bottleneck → ℓ2-norm → prototypes); the
# paper gives none
BOTTLENECK = 256
# Tab. 9f's warm-up on L_nCLIP at the CPU presets (tiny, nclip-tiny: 50 lr warm-up steps): λ_nCLIP
# is 0 through the lr warm-up, then ramps to its base scale over as many steps (the paper: "after
# warm-up epochs with the linear scheduler to its base scale"; it gives no ramp length)
NCLIP_WARMUP = (50, 50)


def table_settings(name: str) -> dict[str, dict[str, Any]]:
    """Named settings of a paper table: ``a1`` (Appendix Tab. A1, objective ``unified``), ``9a``
    (Tab. 9a: the five (λ1, λ2) rows), ``9c`` (Tab. 9c: nCLIP head with a bottleneck, an ℓ2-norm
    layer, without the last BN), ``9d`` (Tab. 9d: #SL shared of #TL hidden layers, xCLIP), ``9e``
    (Tab. 9e: λ_CLIP with λ_nCLIP = 1, objective xclip) or ``9f`` (Tab. 9f: shared space = yCLIP,
    debiased per-source sampling, warm-up on L_nCLIP; xCLIP)."""
    key = name.lower().removeprefix("tab").removeprefix(".").strip()
    if key == "a1":
        from nclip.objectives.unified import TABLE_A1_SETTINGS

        return {row: {"objective": {"name": "unified", **values}} for row, values in TABLE_A1_SETTINGS.items()}
    if key == "9a":
        rows = [(0, 1), (0.3, 1), (0.5, 1), (0.2, 1.2), (0.5, 1.5)]
        return {f"l1-{a:g}_l2-{b:g}": {"objective.lambda1": a, "objective.lambda2": b} for a, b in rows}
    if key == "9c":
        return {"vanilla": {}, "bottleneck": {"model.nclip_bottleneck": BOTTLENECK},
                "l2-norm": {"model.nclip_l2norm": True}, "no-last-bn": {"model.nclip_last_bn": False}}
    if key == "9d":
        return {f"sl{sl}-tl{tl}": {"model.nclip_shared_layers": sl, "model.nclip_layers": tl}
                for sl, tl in [(0, 1), (0, 2), (1, 2), (2, 3)]}
    if key == "9e":
        return {f"wclip-{w:g}": {"objective.w_clip": w, "objective.w_nclip": 1.0} for w in (1.0, 0.5, 0.2, 0.1)}
    if key == "9f":
        start, ramp = NCLIP_WARMUP
        return {"vanilla": {},
                # Eq. 8 / App. B.2 at Tab. B2's λ1 = 3, λ2 = 4, the paper's shared-space row
                "shared-space": {"objective": {"name": "yclip", "lambda1": 3.0, "lambda2": 4.0}},
                "debiased-sampling": {"data.sampling": "per_source"},
                "nclip-warmup": {"objective.nclip_warmup_start": start, "objective.nclip_warmup_steps": ramp}}
    raise NclipError(f"unknown table {name!r}; available: {', '.join(TABLES)}")


# ---------------------------------------------------------------------------------------------
# grid parsing
# ---------------------------------------------------------------------------------------------

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_OPEN, _CLOSE = "[{(", "]})"


def split_grid(text: str) -> list[str]:
    """Split a --grid string at whitespace outside brackets, braces and quotes."""
    items, cur, depth, quote = [], [], 0, None
    for ch in text:
        if quote:
            cur.append(ch)
            if ch == quote:
                quote = None
            continue
        if ch in "'\"":
            quote = ch
        elif ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth -= 1
            if depth < 0:
                raise NclipError(f"grid {text!r}: unbalanced {ch!r}")
        if ch.isspace() and depth == 0:
            if cur:
                items.append("".join(cur))
                cur = []
            continue
        cur.append(ch)
    if quote or depth:
        raise NclipError(f"grid {text!r}: unclosed {'quote' if quote else 'bracket'}")
    if cur:
        items.append("".join(cur))
    return items


def _check_values(key: str, values: Any, where: str) -> list:
    if not isinstance(values, list):
        raise NclipError(f"{where}: the value must be a YAML list of values, e.g. {key}=[{format_value(values)}]")
    if not values:
        raise NclipError(f"{where}: the list of values is empty")
    seen = []
    for v in values:
        if v in seen:
            raise NclipError(f"{where}: value {format_value(v)} is listed twice")
        seen.append(v)
    return values


def _check_key(key: str, where: str) -> str:
    if not _KEY.match(key):
        raise NclipError(f"{where}: {key!r} is not a config key like objective.lambda1")
    return key


def parse_grid(texts: Iterable[str]) -> dict[str, list]:
    """``["objective.lambda1=[0,0.3] objective.lambda2=[1,1.5]"]`` → {key: [values]} (ordered)."""
    grid: dict[str, list] = {}
    for text in texts:
        items = split_grid(text)
        if not items:
            raise NclipError("grid: empty --grid")
        for item in items:
            key, sep, value = item.partition("=")
            where = f"grid entry {item!r}"
            if not sep or not key:
                raise NclipError(f"{where} is not of the form key=[v1,v2,...]")
            key = _check_key(key.strip(), where)
            try:
                values = yaml.safe_load(value)
            except yaml.YAMLError:
                raise NclipError(f"{where}: cannot parse {value!r} as a YAML list") from None
            if key in grid:
                raise NclipError(f"{where}: key {key} is given twice")
            grid[key] = _check_values(key, values, where)
    _check_nesting(list(grid), "grid")
    return grid


def _check_nesting(keys: list[str], where: str) -> None:
    for a in keys:
        for b in keys:
            if a != b and b.startswith(a + "."):
                raise NclipError(f"{where}: {a} and {b} overlap (one is a section of the other)")


def load_grid_file(path: str | Path) -> tuple[dict[str, list], dict[str, dict] | None]:
    """(grid, settings) from a YAML file::

        grid:                         # optional: a cartesian product, as --grid
          objective.lambda1: [0, 0.3, 0.5]
        settings:                     # optional: named whole configs (dotted keys or sections)
          SwAV: {objective: {name: unified, tau_s: 0.25, uniform: sinkhorn, lambda2: 1}}
          nCLIP: {objective.name: nclip}
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise NclipError(f"grid file not found: {p}")
    doc = parse_yaml(*read_text(p, "grid file"))
    if not isinstance(doc, dict) or not doc or set(doc) - {"grid", "settings"}:
        raise NclipError(f"{p}: the top level must be a mapping with the keys 'grid' and/or 'settings'")
    grid: dict[str, list] = {}
    raw_grid = doc.get("grid") or {}
    if not isinstance(raw_grid, dict):
        raise NclipError(f"{p}: 'grid' must map config keys to lists of values")
    for key, values in raw_grid.items():
        where = f"{p}: grid key {key!r}"
        grid[_check_key(str(key), where)] = _check_values(str(key), values, where)
    _check_nesting(list(grid), f"{p}: grid")
    settings = doc.get("settings")
    if settings is not None:
        if not isinstance(settings, dict) or not settings:
            raise NclipError(f"{p}: 'settings' must map names to config overrides")
        for name, over in settings.items():
            if not isinstance(over, dict):
                raise NclipError(f"{p}: setting {name!r} must be a mapping of config keys to values")
            for key in over:
                _check_key(str(key), f"{p}: setting {name!r}")
        settings = {str(k): v for k, v in settings.items()}
    if not grid and not settings:
        raise NclipError(f"{p}: neither a grid nor settings")
    return grid, settings


# ---------------------------------------------------------------------------------------------
# runs
# ---------------------------------------------------------------------------------------------


@dataclass
class RunSpec:
    """One run of a sweep: its overrides (dotted key → Python value, applied in order)."""

    slug: str
    name: str | None  # named setting (e.g. a Tab. A1 row), if any
    assign: dict[str, Any]  # this run's overrides (setting first, then the grid point)
    values: dict[str, Any] = field(default_factory=dict)  # flattened, for the table (varied keys only)

    def set_args(self) -> list[str]:
        return [f"{k}={yaml_flow(v)}" for k, v in self.assign.items()]


def yaml_flow(value: Any) -> str:
    """A value as a one-line YAML string that yaml.safe_load turns back into the same value."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30, allow_unicode=True)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def format_value(value: Any) -> str:
    """A config value as a table cell, slug part or plot label: ``0.3``, ``true``, ``{name: clip}``."""
    if isinstance(value, bool) or value is None:
        return yaml_flow(value)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (int, str)):
        return str(value)
    return yaml_flow(value)


def flatten(assign: dict[str, Any]) -> dict[str, Any]:
    """Overrides with whole sections (``objective: {name: clip}``) as dotted keys (``objective.name``)."""
    out: dict[str, Any] = {}

    def walk(prefix: str, v: Any):
        if isinstance(v, dict) and v:
            for k, sub in v.items():
                walk(f"{prefix}.{k}", sub)
        else:
            out[prefix] = v

    for k, v in assign.items():
        walk(k, v)
    return out


def short_names(keys: list[str]) -> dict[str, str]:
    """key → its last component, or the whole key where two keys share a last component."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: (tail if last.count(tail) == 1 else k) for k, tail in zip(keys, last)}


def expand(grid: dict[str, list], settings: dict[str, dict] | None = None) -> list[RunSpec]:
    """The runs: named settings (or one unnamed) × the cartesian product of the grid."""
    named = list((settings or {None: {}}).items())
    points = [dict(zip(grid, combo)) for combo in itertools.product(*grid.values())] if grid else [{}]
    runs = []
    for name, over in named:
        for point in points:
            runs.append(RunSpec(slug="", name=name, assign={**over, **point}))
    # the table's columns: every (flattened) grid key, and the setting keys whose values differ
    flats = [flatten(r.assign) for r in runs]
    grid_flats = [flatten({k: r.assign[k] for k in grid}) for r in runs]
    keys: list[str] = []
    for f in grid_flats + flats:
        keys += [k for k in f if k not in keys]
    varied = [k for k in keys if any(k in g for g in grid_flats) or len({format_value(f.get(k)) for f in flats}) > 1]
    used: set[str] = set()
    for run, flat, gflat in zip(runs, flats, grid_flats):
        run.values = {k: flat.get(k) for k in varied}
        # the slug: the setting's name, then the grid point as short-key-value pairs
        names = short_names(list(gflat))
        parts = [run.name] if run.name is not None else []
        parts += [f"{names[k]}-{format_value(v)}" for k, v in gflat.items()]
        slug = "_".join(re.sub(r"[^A-Za-z0-9._+-]+", "-", p).strip("-") for p in parts)[:120] or "run"
        base, n = slug, 1
        while slug in used:
            n += 1
            slug = f"{base}_{n}"
        used.add(slug)
        run.slug = slug
    return runs
