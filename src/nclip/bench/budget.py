"""The bench's time budget (``nclip bench --budget-s``) and the estimate it is checked against.

Every row group (a *stage* of :mod:`nclip.bench.runner`) records its own wall time. Before a stage
starts, the runner asks it what one repeat of it would cost at the least, from the figures measured
so far (the objective rows, which run first, give the model build's, the first step's and a step's
seconds); a stage that would not fit in what is left is skipped, and its rows say so (``skipped:
...``), never a made-up figure. Inside a stage, repeats stop once the deadline has passed (after
at least one), and the objective subprocesses are killed at it. A stage that runs a fixed amount
of work (the real ``nclip train`` path) can still run past the deadline by its estimate's error.

What the GPU defaults (``Sizes.pick(cuda=True)``) cost at ViT-B/16, batch 256, bf16 autocast, on
one H100 — an estimate from the figures of issue 24 (xCLIP step 0.15-0.18 s eager, CLIP step about
0.12 s, a 414 M-parameter model built in a few seconds, a slower first step for cuDNN/cuBLAS
autotune), not a measurement:

=====================================================  ==========
stage                                                   seconds
=====================================================  ==========
process start, imports, CUDA context                     ~5
clip, xclip objective steps (2 subprocesses: start ~6,
  build 2-4, first step ~3, 3 warm-up + 3 x 10 steps)    ~35
trainer vs hand loop (2 builds, warm-up, 3 x 2 windows
  of ~12 steps, final model save ~2)                     ~30
nclip train path (1 build, 4 windows of ~12 steps with
  the real loader, checkpoint + model save ~5-8),
  3 hand windows                                         ~30
data rates, K-Means + PBT at 200k x 128 -> 20k, eval     ~25
--compare open_clip (2 builds, 3 x 2 windows)            ~15
largest batch (10 trainer runs of 2 steps at 64-256
  rows, each a build)                                    ~40
patch dropout 0 / 0.5 / 0.75 (1 build, 3 x 3 windows)    ~10
total                                                    ~190
=====================================================  ==========

So about 3 minutes (2.5 without the last two stages). ``train.compile=true`` adds one compilation of the
towers per model built in the main process (tens of seconds for the first, less for the later ones,
which reuse Dynamo's cache where the graphs match), about 1-2 minutes more: that run can need
``--budget-s 300`` to keep every row; the objective subprocesses run eagerly either way.
"""

from __future__ import annotations

import math
import time

DEFAULT_BUDGET_S = 300.0


class Budget:
    """Wall seconds left to the bench; ``limit_s`` None or 0: no limit."""

    def __init__(self, limit_s: float | None):
        self.limit_s = limit_s if limit_s else math.inf
        self.start = time.perf_counter()

    def spent(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.limit_s - self.spent()

    def deadline(self) -> float:
        """The end of the budget on ``time.perf_counter()``'s clock (in this process)."""
        return self.start + self.limit_s

    def wall_deadline(self) -> float:
        """The end of the budget on ``time.time()``'s clock (for a subprocess)."""
        return time.time() + self.left()

    def why_not(self, estimate_s: float | None) -> str | None:
        """None where a stage whose one repeat costs about ``estimate_s`` (None: unknown) may start;
        otherwise the reason it is skipped."""
        left = self.left()
        if left <= 0:
            return f"skipped: the {self.limit_s:.0f} s budget ran out"
        if estimate_s is not None and estimate_s > left:
            return f"skipped: needs about {estimate_s:.0f} s, {left:.0f} s of the {self.limit_s:.0f} s budget left"
        return None
