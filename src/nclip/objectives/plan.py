"""The objective plan: a run's objective, resolved once, answering what the rest of nclip asks.

Trainer, model, data, evaluation, export and sweeps ask the plan (:func:`plan_for`) which heads to
build, how many views and which labels a batch carries, whether the episodic trainer drives it,
which score transfers zero-shot (a :class:`~nclip.objectives.scores.Score`), what the probes read,
what the collapse monitor watches, and for the objective module itself (:meth:`ObjectivePlan.build`).
Nothing else reads the registry, so an objective of the user's own (``objective.name: module:Class``)
gets what a built-in gets. A plan names only registered heads and a registered score that reads a head
it builds: one that does not is refused when it is made, i.e. when the run config is resolved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nclip.heads import probe_problem, registered_heads
from nclip.objectives.base import CollapseWatch, LabelRequest, LabelSpace, Objective, ObjectiveConfig
from nclip.objectives.registry import objective_class, plugin_source
from nclip.objectives.scores import Score, score_named


@dataclass(frozen=True)
class ObjectivePlan:
    """What a run's objective needs and offers (the class attributes of :class:`Objective`,
    resolved for this run's config)."""

    name: str
    objective_class: type[Objective]
    config: ObjectiveConfig
    heads: frozenset[str]  # the heads the model builds (Objective.heads_for)
    views: int  # augmented views per image in a training batch
    episodic: bool  # driven by nclip.train.episodic
    # the score of zero-shot transfer and retrieval, with the run's options (eval.nclip_score); None:
    # an image-only objective, evaluated by the probes
    zero_shot: Score | None
    probe_features: str  # the image features the probes read by default: backbone or a head's name
    sgd_probe_recipe: str  # the SGD linear probe of the objective's paper
    collapse_watch: CollapseWatch | None  # what the collapse monitor reads (App. B.1)
    needs_label_space: bool  # built with the run's classes
    several_captions: bool  # takes several positive captions per image (data.caption_choice all)
    hard_negatives: bool  # takes hard negative captions (data.hard_negative_key, data.hard_negatives)
    run_cfg: Any = None  # the RunConfig the plan was made for (None: the objective section alone)
    # a plugin's (path, sha256) of the file defining its class, as imported; None for a built-in
    source_file: tuple[str, str] | None = None

    def label_request(self) -> LabelRequest | None:
        """The per-row labels the training batches carry (None: none)."""
        return self.objective_class.label_request(self.run_cfg)

    def hierarchy_request(self) -> str | None:
        """For an objective that needs the label space: the class hierarchy it wants, if any."""
        return self.objective_class.hierarchy_request(self.config)

    def check_run(self) -> None:
        """Refuse (ValueError, one line) a run config the objective cannot train on."""
        self.objective_class.check_run(self.run_cfg)

    def probe_problem(self, features: str) -> str | None:
        """Why this objective's model has no probe features ``features`` (one line, naming the
        objective), or None when it has them."""
        problem = probe_problem(features, self.heads)
        return None if problem is None else f"objective {self.name!r} {problem}"

    def build(self, label_space: LabelSpace | None = None) -> Objective:
        """The objective module for this run; ``label_space`` the run's classes, for an objective
        that ``needs_label_space`` (ignored by the others)."""
        cls = self.objective_class
        if cls.needs_label_space:
            return cls.build(self.config, self.run_cfg, label_space=label_space)
        return cls.build(self.config, self.run_cfg)


def plan_for(run_cfg) -> ObjectivePlan:
    """The plan of ``run_cfg``'s objective (a :class:`nclip.config.RunConfig`)."""
    return plan_of(run_cfg.objective, run_cfg)


def plan_of(config: ObjectiveConfig, run_cfg=None) -> ObjectivePlan:
    """The plan of an objective section alone (``run_cfg`` None: what needs the whole run config,
    :meth:`ObjectivePlan.label_request` and :meth:`~ObjectivePlan.check_run`, is then unavailable)."""
    cls = objective_class(config.name)
    heads = frozenset(cls.heads_for(config))
    plan = ObjectivePlan(
        name=config.name,
        objective_class=cls,
        config=config,
        heads=heads,
        views=cls.views,
        episodic=bool(cls.episodic),
        zero_shot=_zero_shot(config.name, cls.zero_shot, heads, run_cfg),
        probe_features=cls.probe_features,
        sgd_probe_recipe=cls.sgd_probe_recipe,
        collapse_watch=cls.collapse_watch(config),
        needs_label_space=bool(cls.needs_label_space),
        several_captions=bool(cls.several_captions),
        hard_negatives=bool(cls.hard_negatives),
        run_cfg=run_cfg,
        source_file=plugin_source(config.name),
    )
    if problem := plan.probe_problem(plan.probe_features):
        raise ValueError(f"{cls.__name__}.probe_features {plan.probe_features!r}: {problem}")
    return plan


def _zero_shot(objective: str, name: str | None, heads: frozenset[str], run_cfg) -> Score | None:
    """The objective's score, with the run's options; a one-line ValueError for a head that no head
    kind is registered as, an unknown score, or a score that reads a head the model does not build."""
    unknown = sorted(heads - {cls.name for cls in registered_heads()})
    if unknown:
        raise ValueError(f"objective {objective!r} names the head {unknown[0]!r}, which is not registered "
                         f"(registered: {', '.join(cls.name for cls in registered_heads())})")
    if name is None:
        return None
    try:
        score = score_named(name)
    except ValueError as e:
        raise ValueError(f"objective {objective!r}: its zero_shot: {e}") from None
    if score.head not in heads:
        raise ValueError(f"objective {objective!r}: its zero-shot score {name!r} reads the {score.head!r} head, "
                         f"which it does not build (it has {', '.join(sorted(heads))})")
    eval_cfg = getattr(run_cfg, "eval", None)  # build_objective may pass the sections that size it alone
    return score.configured(eval_cfg) if eval_cfg is not None else score
