"""What the stages of ``nclip bench`` share (:mod:`nclip.bench.runner` runs them,
:mod:`nclip.bench.stages` holds them): the run's state (:class:`Bench`), a :class:`Stage`, the way a
stage gives up for the budget (:class:`OutOfBudget`), and what models of the run cost in seconds
(:func:`models_seconds`, the stages' estimates)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from nclip.bench.budget import COMPILE_GUESS_S, Budget, ModelCosts, Sizes
from nclip.bench.report import Report
from nclip.bench.shared_models import ModelCache


@dataclass
class Bench:
    """What the stages share: the run's config and sizes, the budget, the report, and what one
    stage measured that a later one uses (the objectives' step costs, the trainer row's results and
    hand loop)."""

    preset: str
    overrides: list[str]
    cfg: object  # RunConfig
    device: object  # torch.device
    sizes: Sizes
    budget: Budget
    log: Callable[[str], None]
    rep: Report = field(default_factory=Report)
    details: dict = field(default_factory=dict)
    headline: dict = field(default_factory=dict)
    costs: dict | None = None
    loop: dict | None = None
    memory_gib: float | None = None  # --memory-gib: the largest-batch rows' limit
    models: ModelCache = field(default_factory=ModelCache)  # this process's models (shared_models)
    child_models: dict = field(default_factory=lambda: {"builds": 0, "copies": 0})  # the subprocesses'
    hand: object = None  # the trainer row's HandLoop, for the train-path row
    compile_s: float | None = None  # one compilation of the towers, timed by the trainer row's hand loop

    def step_costs(self) -> ModelCosts | None:
        """What a model of the run costs at the least (:class:`ModelCosts`), from what this process has
        built, copied and compiled so far, the trainer row's step once measured, and before it the
        objective rows' figures: the run's objective's where it is one of them, else the cheaper one
        (a CMSF preset's xCLIP row, with the model's default nCLIP heads, can step 40x slower than
        CMSF). None before the objective rows."""
        if not self.costs:
            return None
        c = self.costs.get(self.cfg.objective.name) or min(self.costs.values(), key=lambda r: r["step_s"])
        m = self.models
        compile_s = (self.compile_s if self.compile_s is not None else COMPILE_GUESS_S) if self.cfg.train.compile else 0
        return ModelCosts(build_s=max(m.build_s, default=c["build_s"]), copy_s=max(m.copy_s, default=c["copy_s"]),
                          compile_s=compile_s, first_s=c["first_step_s"],
                          step_s=self.loop["trainer_step_s"] if self.loop else c["step_s"])

    def add_child_models(self, counts: dict) -> None:
        for k in self.child_models:
            self.child_models[k] += counts[k]

    def add_ratio(self, headline: str, row: str, result: dict, detail: str, details: str) -> None:
        """A measured ratio, ``result["ratio"]``: a row of the table, a headline of the JSON under
        ``headline``, and ``result`` whole among the JSON's details under ``details``."""
        self.headline[headline] = result["ratio"]
        self.rep.add(row, result["ratio"], detail)
        self.details[details] = result


@dataclass(frozen=True)
class Stage:
    name: str
    rows: tuple[str, ...]  # the rows it adds (named when it is skipped)
    run: Callable[[Bench], None]
    estimate: Callable[[Bench], float | None] = lambda b: None  # one repeat's seconds; None: unknown


class OutOfBudget(Exception):
    """A stage stops without a figure; its message (``skipped: ...``) is the rows' detail."""


def models_seconds(b: Bench, count: int, windows: float, cfg=None, builds: int | None = None,
                   compiled: bool = True) -> float | None:
    """Seconds for ``count`` models of ``cfg`` (default the run's): a build where the bench has none
    of that config yet (or ``builds``), copies for the others, each compiled with ``train.compile``
    (where ``compiled``), with a first step and ``windows`` windows' steps."""
    c = b.step_costs()
    if c is None:
        return None
    from nclip.bench.loop_overhead import steps_for

    cfg = cfg or b.cfg
    builds = (0 if b.models.has(cfg) else min(count, 1)) if builds is None else builds
    steps = count * windows * steps_for(c.step_s, b.sizes.loop_window_s)
    return c.seconds(builds, count - builds, steps, compiles=count if compiled and cfg.train.compile else 0)
