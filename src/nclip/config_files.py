"""The config's text, read without its models (so without pydantic and torch): the shipped presets'
names and one-line descriptions (``nclip presets``), and ``--set key=value`` overrides.

A preset's description is the first line of its header comment, a summary that stands alone; the
lines after it say why each setting is what it is. (A ``description:`` key would be a config key,
and unknown keys are errors.)
"""

from __future__ import annotations

import copy
from importlib import resources
from typing import Any

from nclip.errors import NclipError

SUFFIX = ".yaml"


def preset_dir():
    return resources.files("nclip") / "presets"


def preset_names() -> list[str]:
    return sorted(p.name[: -len(SUFFIX)] for p in preset_dir().iterdir() if p.name.endswith(SUFFIX))


def preset_text(name: str) -> str:
    """The YAML text of the shipped preset ``name``; an unknown name is a one-line error listing them."""
    path = preset_dir() / f"{name}{SUFFIX}"
    if not path.is_file():
        raise NclipError(f"unknown preset {name!r}; available: {', '.join(preset_names())}")
    return path.read_text(encoding="utf-8")


def preset_description(name: str) -> str:
    """The first line of the shipped preset's header comment ("" without one)."""
    first = preset_text(name).lstrip().partition("\n")[0]
    return first.removeprefix("#").strip() if first.startswith("#") else ""


def preset_table() -> str:
    """One line per shipped preset: its name and description, aligned."""
    names = preset_names()
    width = max(map(len, names))
    return "\n".join(f"{name:<{width}}  {preset_description(name)}".rstrip() for name in names)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides; values are parsed as YAML (numbers, lists, booleans)."""
    import yaml

    out = copy.deepcopy(raw)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise NclipError(f"override {item!r} is not of the form key=value")
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            raise NclipError(f"override {item!r}: cannot parse the value") from None
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise NclipError(f"override {item!r}: {part!r} is not a section")
            node = child
        node[parts[-1]] = parsed
    return out


# settings a preset makes for its built-in synthetic scenes that no other source has
SYNTHETIC_ONLY = {"hard_negative_group": 1}


def synthetic_settings_give_way(raw: dict, overrides: list[str]) -> dict:
    """A preset's synthetic-scene settings give way to a user's data source: ``--preset tiny --set
    data.source=csv`` trains on the CSV instead of failing on tiny's hard-negative groups (made of synthetic scenes);
    the start-up block says so (:func:`gave_way`). A setting the user gave stays, and is checked."""
    data = raw.get("data") or {}
    if data.get("source", "synthetic") == "synthetic":
        return raw
    given = {item.partition("=")[0].strip() for item in overrides}
    for key, default in SYNTHETIC_ONLY.items():
        if key in data and f"data.{key}" not in given:
            data[key] = default
    return raw


def gave_way(preset_raw: dict, cfg) -> list[str]:
    """The preset's synthetic-scene settings this config set back for its data source, as
    ``key preset_value -> value`` strings (for the start-up block)."""
    data = preset_raw.get("data") or {}
    if cfg.data.source == "synthetic":
        return []
    return [f"data.{k} {data[k]} -> {getattr(cfg.data, k)}" for k in SYNTHETIC_ONLY
            if k in data and data[k] != getattr(cfg.data, k)]
