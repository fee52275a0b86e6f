"""What a sweep is asked to do."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class SweepOptions:
    preset: str
    out: Path
    grid: dict[str, list] = field(default_factory=dict)
    settings: dict[str, dict] | None = None
    overrides: list[str] = field(default_factory=list)
    parallel: int | None = None
    threads: int | None = None
    resume: bool = False
    probe_train: int = 2000
    probe_test: int = 1000
    source: dict = field(default_factory=dict)  # how the grid was given (for sweep.json)
