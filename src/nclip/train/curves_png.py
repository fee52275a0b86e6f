"""RUN/curves.png beside metrics.jsonl: the loss terms and the evaluation while training
(``train.eval_every``) over the steps, redrawn while the run trains (rank 0; docs/runs.md).

The panels are the report's (:func:`nclip.eval.curve_panels.curve_panels`: one kind of quantity
per panel under its unit, drawn by :func:`nclip.eval.figures.curves_plot`), narrowed to the
losses (total, the objective's terms) and the evaluations. The figure is read back from
metrics.jsonl, so a resumed run draws its whole history, and written to a temporary file beside it
then renamed, so a reader never sees half a PNG.

When: at a log step when the time since the last drawing is at least :data:`BUDGET` times what the
drawing took (so it costs at most ~1/BUDGET of the wall time), at every checkpoint step and at
the end of the run, each time only if a row was logged since. Nothing here touches the model, the
device or an RNG: the run's numbers are the same with or without it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from nclip.jsonio import read_jsonl, writing

CURVES = "curves.png"
BUDGET = 20  # a log step redraws only after BUDGET x the last drawing's time: <= ~5 % of the wall time
DPI = 90


def panels_to_draw(rows: list[dict]) -> list:
    """The report's panels of ``rows`` that hold losses or the evaluation while training."""
    from nclip.eval.curve_panels import KINDS, curve_panels

    panels, _ = curve_panels(rows)
    return [p for p in panels if p.ylabel == KINDS["loss"][0] or all(k.startswith("eval/") for k in p.keys)]


def write_curves(metrics: Path, out: Path) -> bool:
    """Draw ``out`` (a PNG) from the rows of ``metrics`` (metrics.jsonl); False when there is
    nothing to draw yet."""
    from nclip.eval.figures import curves_plot

    rows = [r for r in read_jsonl(metrics) if isinstance(r.get("step"), int)]
    panels = panels_to_draw(rows)
    if not panels:
        return False
    fig = curves_plot(rows, panels, title=f"{out.parent.name}: losses and evaluations to step {rows[-1]['step']}",
                      tight=False)
    tmp = out.with_name(f".{out.name}.tmp")
    with writing(out):
        fig.savefig(tmp, format="png", dpi=DPI)
        os.replace(tmp, out)
    return True


class CurvesPng:
    """Redraws RUN/curves.png as :class:`nclip.train.logbook.Log` writes rows (see the module
    docstring for when). ``seconds``: the time spent drawing, for the cost in docs/runs.md."""

    def __init__(self, run_dir: Path, metrics: Path, checkpoint_every: int, steps: int, start: int = 0):
        self.out, self.metrics = Path(run_dir) / CURVES, Path(metrics)
        if start == 0:  # a run started over (--force): the old run's figure goes
            self.out.unlink(missing_ok=True)
        self.checkpoint_every, self.steps = checkpoint_every, steps
        # cost: a guess until the first drawing, so that a run of a few seconds draws at its
        # checkpoints and its end only
        self.pending, self.cost, self.seconds, self.drawn_at = False, 0.1, 0.0, time.perf_counter()

    def after_step(self, done: int, wrote_row: bool) -> None:
        self.pending |= wrote_row
        if not self.pending:
            return
        checkpoint = done % self.checkpoint_every == 0 or done == self.steps
        if checkpoint or (wrote_row and time.perf_counter() - self.drawn_at >= BUDGET * self.cost):
            self.draw()

    def close(self) -> None:
        if self.pending:
            self.draw()

    def draw(self) -> None:
        started = time.perf_counter()
        write_curves(self.metrics, self.out)
        self.drawn_at = time.perf_counter()
        self.cost = self.drawn_at - started
        self.seconds += self.cost
        self.pending = False
