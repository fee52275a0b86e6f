"""The objective plan: a run's objective, resolved once, answering what the rest of nclip asks.

Trainer, model, data, evaluation, export and sweeps ask the plan (:func:`plan_for`) which heads to
build, how many views and which labels a batch carries, whether the episodic trainer drives it,
which head scores zero-shot, what the probes read, what the collapse monitor watches, and for the
objective module itself (:meth:`ObjectivePlan.build`). Nothing else reads the registry, so an
objective of the user's own (``objective.name: module:Class``) gets what a built-in gets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nclip.objectives.base import CollapseWatch, LabelRequest, LabelSpace, Objective, ObjectiveConfig
from nclip.objectives.registry import objective_class, plugin_source


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
    zero_shot_head: str | None  # the score of zero-shot transfer and retrieval; None: probes only
    probe_features: str  # the image features the probes read by default
    sgd_probe_recipe: str  # the SGD linear probe of the objective's paper
    collapse_watch: CollapseWatch | None  # what the collapse monitor reads (App. B.1)
    needs_label_space: bool  # built with the run's classes
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
    return ObjectivePlan(
        name=config.name,
        objective_class=cls,
        config=config,
        heads=frozenset(cls.heads_for(config)),
        views=cls.views,
        episodic=bool(cls.episodic),
        zero_shot_head=cls.zero_shot_head,
        probe_features=cls.probe_features,
        sgd_probe_recipe=cls.sgd_probe_recipe,
        collapse_watch=cls.collapse_watch(config),
        needs_label_space=bool(cls.needs_label_space),
        run_cfg=run_cfg,
        source_file=plugin_source(config.name),
    )
