"""What a sweep is asked to do, typed and checked in one place, as the run config is: ``nclip
sweep`` turns a pydantic error here into the run config's one-line error naming the option
(:func:`nclip.config.describe_validation_error`)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SweepOptions(BaseModel):
    """The options of ``nclip sweep`` (see :func:`nclip.sweep.run_sweep`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    preset: str
    out: Path  # the sweep directory: runs in OUT/runs/<slug>
    grid: dict[str, list] = Field(default_factory=dict)  # key → values, from nclip.sweep.grid.parse_grid
    settings: dict[str, dict] | None = None  # name → overrides (a paper table or a grid file)
    overrides: list[str] = Field(default_factory=list)  # --set of every run
    parallel: int | None = Field(None, ge=1, description="runs at once (default: cores // threads per run)")
    threads: int | None = Field(None, ge=1, description="train.threads of each run (default: the preset's; "
                                                        "else 1, or cores // parallel)")
    resume: bool = False
    force: bool = False  # write into an OUT that holds files other than a sweep's
    probe_train: int = Field(2000, ge=10, description="held-out images to fit the linear probe")
    probe_test: int = Field(1000, ge=10, description="held-out images to test the linear probe")
    source: dict = Field(default_factory=dict)  # how the grid was given (for sweep.json)

    @model_validator(mode="after")
    def _something_to_sweep(self):
        if not self.grid and not self.settings:
            raise ValueError("nothing to sweep: give --grid, --grid-file or --table")
        return self
