"""The base of every section of the run configuration: frozen, unknown keys are errors. And the
check of a setting whose optional package may be missing."""

from __future__ import annotations

import importlib.util

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def require_package(name: str, message: str) -> None:
    """Refuse a setting whose optional package is not installed (a config error naming the extra)."""
    if importlib.util.find_spec(name) is None:
        raise ValueError(message)
