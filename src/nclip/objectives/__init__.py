"""Objectives: pure functions in :mod:`functional`, trainer modules registered by name in
:mod:`registry`, zero-shot scores registered by name in :mod:`scores`, and the plan (:mod:`plan`)
through which the rest of nclip asks about a run's objective.

Adding an objective = a functional section + a module with a typed config + one REGISTRY entry;
an objective of the user's own needs none of them (docs/plugins.md).
"""

from __future__ import annotations

from nclip.objectives.base import EncoderOutput, LabelSpace, Objective, ObjectiveConfig
from nclip.objectives.plan import ObjectivePlan, plan_for, plan_of
from nclip.objectives.registry import REGISTRY
from nclip.objectives.scores import Score, register_score, score_named


def build_objective(cfg: ObjectiveConfig, run_cfg=None, label_space: LabelSpace | None = None) -> Objective:
    """The registered objective for ``cfg``; ``run_cfg`` (the RunConfig) gives it sizes from other
    sections (see :meth:`Objective.build`); ``label_space`` the run's classes (and class similarity)
    for an objective that ``needs_label_space`` (ignored by the others)."""
    return plan_of(cfg, run_cfg).build(label_space)


__all__ = ["REGISTRY", "build_objective", "EncoderOutput", "LabelSpace", "Objective", "ObjectiveConfig",
           "ObjectivePlan", "Score", "plan_for", "plan_of", "register_score", "score_named"]
