"""The bench's time budget (``nclip bench --budget-s``) and the estimate it is checked against.

Every row group (a *stage* of :mod:`nclip.bench.runner`) records its own wall time. Before a stage
starts, the runner asks it what one repeat of it would cost at the least (:class:`ModelCosts`),
from the figures measured so far: the objective rows, which run first, give a model build's, a
model copy's, the first step's and a step's seconds and a subprocess's start; the builds and copies
of this process (:mod:`nclip.bench.shared_models`: a stage pays a build only for a model config the
bench has not built yet, a copy otherwise) and, with ``train.compile``, one compilation per model
(:data:`COMPILE_GUESS_S` until the trainer row's hand loop has timed one). A stage that would not
fit in what is left is skipped, and its rows say so (``skipped: ...``), never a made-up figure. The
JSON keeps each stage's estimate beside its wall time. Inside a stage, repeats stop once the deadline
has passed (after at least one), and the objective subprocesses are killed at it. A stage that runs
a fixed amount of work (the real ``nclip train`` path) can still run past the deadline by its
estimate's error.

What the GPU defaults (``Sizes.pick(cuda=True)``) cost at ViT-B/16, batch 256, bf16 autocast, on
one H100 — an estimate from earlier H100 measurements (xCLIP step 0.15-0.18 s eager, CLIP step about
0.12 s, a 414 M-parameter model built in a few seconds, a slower first step for cuDNN/cuBLAS
autotune) and of a copy of 1.66 GB of weights (about 1 s to copy and move to the GPU), not a
measurement:

=====================================================  ==========
stage                                                   seconds
=====================================================  ==========
process start, imports, CUDA context                     ~5
clip, xclip objective steps (2 subprocesses: start ~6,
  build 2-4, first step ~3, 3 warm-up + 3 x 10 steps)    ~35
trainer vs hand loop (1 build, 1 copy, warm-up, 3 x 2
  windows of ~12 steps; nothing written)                 ~25
nclip train path (1 copy, 4 windows of ~12 steps with
  the real loader; no checkpoint or model written),
  3 hand windows                                         ~22
data rates, K-Means + PBT at 200k x 128 -> 20k, eval
  (4,096 scenes made by one process per core)            ~22
--compare open_clip (2 builds, 3 x 2 windows)            ~15
largest batch (9 trainer runs of 2 steps at 64-256
  rows: 1 build, the checkpointed model, 9 copies)       ~25
patch dropout 0 / 0.5 / 0.75 (1 copy, 3 x 3 windows)     ~8
total                                                    ~155
=====================================================  ==========

So about 2.5 minutes (2 without the last two stages), because the bench builds each model once and
writes no model or checkpoint: that spares about 16 builds, 13 model saves (1.66 GB each) and a 5 GB
checkpoint. ``train.compile=true`` adds one compilation of the towers per training run in the main
process (tens of seconds for the first, less for the later ones, which reuse Dynamo's cache where the
graphs match), about 1-2 minutes more: that run can need ``--budget-s 300`` to keep every row; the
objective subprocesses run eagerly either way.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

DEFAULT_BUDGET_S = 300.0
# one compilation of the training step, before the bench has timed one (the trainer row's hand loop times the
# first): the "tens of seconds" measured for ViT-B/16 on an H100, rounded up; an assumption, never a figure
COMPILE_GUESS_S = 60.0


@dataclass
class Sizes:
    """How much each row measures: the CPU defaults (about a minute on 2 cores at micro), ``--quick``
    (a smoke test), or a GPU's (about 2.5 minutes at ViT-B/16 batch 256 on an H100, estimated in
    :mod:`nclip.bench.budget`)."""

    objective_steps: int = 5
    objective_warmup: int = 2
    objective_repeats: int = 2
    loop_repeats: int = 3
    loop_window_s: float = 0.4
    data_64: int = 1000
    data_224: int = 100
    kmeans: tuple[int, int, int] = (20_000, 2_000, 20)  # N, K, iterations
    kmeans_note: str = "1/10 of the paper's N and K (CPU default)"
    eval_images: int = 512
    # largest batch per device (nclip.bench.batch_memory): plain and checkpointed steps at these
    # batches (None: a quarter, half and all of the run's), exact accumulation at micro-batch
    # mem_micro (None: an eighth of the run's batch) with each k of mem_ks
    mem_batches: tuple[int, ...] | None = (64, 128, 256)
    mem_micro: int | None = 32
    mem_ks: tuple[int, ...] = (2, 4, 8)

    @classmethod
    def pick(cls, quick: bool, cuda: bool) -> Sizes:
        if quick:
            return cls(objective_steps=2, objective_warmup=1, objective_repeats=1, loop_repeats=2,
                       loop_window_s=0.05, data_64=50, data_224=5, kmeans=(2_000, 50, 3),
                       kmeans_note="a smoke-test scale (--quick)", eval_images=32, mem_batches=(32, 128),
                       mem_micro=16, mem_ks=(2, 8))
        if cuda:
            # ViT-B/16 xCLIP at batch 256: ~0.17 s a step, so 10-step objective windows and ~12-step
            # loop windows; each model built once for the whole bench (nclip.bench.budget: ~155 s in all)
            return cls(objective_steps=10, objective_warmup=3, objective_repeats=3, loop_repeats=3,
                       loop_window_s=2.0, kmeans=(200_000, 20_000, 20), kmeans_note="the paper's scale",
                       eval_images=4096, mem_batches=None, mem_micro=None)
        return cls()


@dataclass(frozen=True)
class ModelCosts:
    """What a stage pays per model, in seconds, from what the bench has measured so far: a build (the
    first of a config; :mod:`nclip.bench.shared_models`), a copy (every later one), one compilation
    of the training step (0 without ``train.compile``), a first step and a step."""

    build_s: float
    copy_s: float
    compile_s: float
    first_s: float
    step_s: float

    def seconds(self, builds: int, copies: int, steps: float, compiles: int = 0) -> float:
        """``builds`` new models and ``copies`` copies, each with a first step; ``compiles``
        compilations; ``steps`` further steps."""
        return (builds * self.build_s + copies * self.copy_s + compiles * self.compile_s
                + (builds + copies) * self.first_s + steps * self.step_s)


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
