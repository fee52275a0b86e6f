"""The run's label space for objectives that need it (``Objective.needs_label_space``): the class names
of the labels the run trains on and, where the objective asks for one (``hierarchy_request``), the
normalised class similarity s [C, C] of a class hierarchy (ReCo, OmniBenchmark Eq. 4).

Objectives (layer 1) may not import the data layer (3) that knows the classes and their hierarchy,
so the trainer builds the :class:`~nclip.objectives.base.LabelSpace` here and passes it to
:func:`nclip.objectives.build_objective`.

Hierarchies come from :mod:`nclip.hierarchy` (``Hierarchy.load(path)``,
``Hierarchy.normalized_similarity(classes)``) and :func:`nclip.data.hierarchies.builtin_hierarchy`.
"""

from __future__ import annotations

import torch

from nclip.config import RunConfig
from nclip.errors import NclipError
from nclip.objectives import REGISTRY
from nclip.objectives.base import LabelRequest, LabelSpace


def _class_names(cfg: RunConfig, key: str | None) -> tuple[str, tuple[str, ...]]:
    from nclip.data.loader import build_dataset, label_space

    kind, _ = label_space(cfg, key)  # one-line errors for unlabelled sources and unknown kinds
    return kind, tuple(build_dataset(cfg, "test", length=1).label_spaces[kind].names)


def class_similarity(cfg: RunConfig, request: str, kind: str, classes: tuple[str, ...]) -> torch.Tensor:
    """s [C, C] in [0, 1] for ``classes``: of the file ``request``, or of the source's built-in
    hierarchy of label kind ``kind`` when ``request`` is ``"builtin"``."""
    from nclip.hierarchy import Hierarchy

    if request == "builtin":
        from nclip.data.hierarchies import builtin_hierarchy

        tree = builtin_hierarchy(cfg.data.source, kind)
    else:
        tree = Hierarchy.load(request)
    tree.check_covers(classes)
    s = torch.as_tensor(tree.normalized_similarity(list(classes)), dtype=torch.float32)
    if tuple(s.shape) != (len(classes),) * 2:
        raise NclipError(f"the class similarity of {request} has shape {tuple(s.shape)}, expected "
                         f"{(len(classes),) * 2}")
    return s.clamp(0, 1)


def label_space_for(cfg: RunConfig) -> LabelSpace | None:
    """The :class:`LabelSpace` of ``cfg``'s run for its objective, or None when the objective needs none
    or the data has no labels."""
    objective = REGISTRY[cfg.objective.name][1]
    if not objective.needs_label_space:
        return None
    request = objective.label_request(cfg)
    if request is None:
        return None
    kind, classes = _class_names(cfg, (request or LabelRequest()).key)
    hierarchy = objective.hierarchy_request(cfg.objective)
    similarity = class_similarity(cfg, hierarchy, kind, classes) if hierarchy is not None else None
    return LabelSpace(classes, similarity)
