"""The run's label space for objectives that need it (``Objective.needs_label_space``): the class names
of the labels the run trains on and, where the objective asks for one (``hierarchy_request``), the
normalised class similarity s [C, C] of a class hierarchy (ReCo, OmniBenchmark Eq. 4).

Objectives (layer 1) may not import the data layer (3) that knows the classes and their hierarchy,
so the trainer builds the :class:`~nclip.objectives.base.LabelSpace` here and passes it to
:func:`nclip.objectives.build_objective`.

Class names are those of the run's labels (:func:`nclip.data.loader.label_space`): the built-in data's,
a class-folder tree's (folder names, ``_`` and ``-`` as spaces) or a CSV label column's values.
Hierarchies come from :mod:`nclip.hierarchy` (``Hierarchy.load(path)``,
``Hierarchy.normalized_similarity(classes)``) and :func:`nclip.data.hierarchies.builtin_hierarchy`.
A user's file must fit the classes (``Hierarchy.check_classes``: every class a node, every leaf a
class), checked before any step, one line naming what is missing or extra.
"""

from __future__ import annotations

import torch

from nclip.config import RunConfig
from nclip.errors import NclipError
from nclip.objectives import plan_for
from nclip.objectives.base import LabelRequest, LabelSpace


def _class_names(cfg: RunConfig, key: str | None) -> tuple[str, tuple[str, ...]]:
    from nclip.data.loader import label_space

    kind, space = label_space(cfg, key)  # one-line errors for unlabelled sources and unknown kinds
    return kind, tuple(space.names)


def _classes_of(cfg: RunConfig) -> str:
    """Where the run's class names come from, for error messages."""
    d = cfg.data
    if d.source == "folder":
        return f"the class folders of data.folder {d.folder}"
    if d.source == "csv":
        return f"data.csv_label_key {d.csv_label_key!r} of {d.csv}"
    return f"data.source {d.source}"


def class_similarity(cfg: RunConfig, request: str, kind: str, classes: tuple[str, ...]) -> torch.Tensor:
    """s [C, C] in [0, 1] for ``classes``: of the file ``request``, or of the source's built-in
    hierarchy of label kind ``kind`` when ``request`` is ``"builtin"``."""
    from nclip.hierarchy import Hierarchy

    if request == "builtin":
        from nclip.data.hierarchies import builtin_hierarchy

        tree = builtin_hierarchy(cfg.data.source, kind)
        tree.check_covers(classes)
    else:
        tree = Hierarchy.load(request)  # its errors name the file
    try:
        if request != "builtin":
            tree.check_classes(classes, of=f"of {_classes_of(cfg)}")
        s = torch.as_tensor(tree.normalized_similarity(list(classes)), dtype=torch.float32)
    except NclipError as e:  # a mismatch, or two classes in different trees of a forest
        raise NclipError(f"objective.hierarchy {request}: {e}") from None
    if tuple(s.shape) != (len(classes),) * 2:
        raise NclipError(f"the class similarity of {request} has shape {tuple(s.shape)}, expected "
                         f"{(len(classes),) * 2}")
    return s.clamp(0, 1)


def label_space_for(cfg: RunConfig) -> LabelSpace | None:
    """The :class:`LabelSpace` of ``cfg``'s run for its objective, or None when the objective needs none
    or the data has no labels."""
    objective = plan_for(cfg)
    if not objective.needs_label_space:
        return None
    request = objective.label_request()
    if request is None:
        return None
    kind, classes = _class_names(cfg, (request or LabelRequest()).key)
    hierarchy = objective.hierarchy_request()
    similarity = class_similarity(cfg, hierarchy, kind, classes) if hierarchy is not None else None
    return LabelSpace(classes, similarity)
