"""The labels of a run's training source, in one place: the label kinds the source has (class names
and prompt templates, :class:`~nclip.data.types.LabelKind`), the kind a config key names, the
tagging captions that name a row's class (``data.tagging``, :func:`tag_captions`), and the
run's :class:`~nclip.objectives.base.LabelSpace` that an objective with ``needs_label_space`` is
built with (the class names of the labels it trains on and, where the objective asks for one
(``hierarchy_request``), the normalised class similarity s [C, C] of a class hierarchy: ReCo,
OmniBenchmark Eq. 4).

Objectives (layer 1) may not import the data layer that knows the classes and their hierarchy, so
the trainer builds their label space here (:func:`label_space_for`) and passes it to
:func:`nclip.objectives.build_objective`; the number of classes an objective is built for is
:func:`nclip.objectives.base.class_count` of it.

Class names are those of the source: the built-in data's, a class-folder tree's (folder names, ``_``
and ``-`` as spaces) or a CSV label column's values. Hierarchies come from :mod:`nclip.data.hierarchy`
(``Hierarchy.load(path)``, ``Hierarchy.normalized_similarity(classes)``) and
:func:`nclip.data.hierarchies.builtin_hierarchy`. A user's file must fit the classes
(``Hierarchy.check_classes``: every class a node, every leaf a class), checked before any step, one
line naming what is missing or extra.
"""

from __future__ import annotations

import torch

from nclip.config import RunConfig
from nclip.data.sources import MAIN_LABEL, build_dataset
from nclip.data.tagging import TagCaptions
from nclip.data.types import LabelKind
from nclip.defaults import BUILTIN_SOURCES, USER_LABEL, has_labels
from nclip.errors import NclipError
from nclip.objectives import plan_for
from nclip.objectives.base import LabelRequest, LabelSpace


def train_label_kinds(cfg: RunConfig) -> dict[str, LabelKind]:
    """The label kinds of the training source, with their class names and prompt templates ({}: the
    source has no labels). A CSV's or a folder's one kind is ``label``."""
    d = cfg.data
    if not has_labels(d):
        return {}
    if d.source in BUILTIN_SOURCES:
        return dict(build_dataset(cfg, "test", length=1).label_kinds)
    if d.source == "folder":
        return build_dataset(cfg, "train").label_kinds
    from nclip.data.csv_source import label_names
    from nclip.data.folders import FOLDER_TEMPLATES

    return {USER_LABEL: LabelKind(label_names(cfg), FOLDER_TEMPLATES)}


def label_kind(cfg: RunConfig, key: str | None = None, what: str = "objective.label_key") -> tuple[str, LabelKind]:
    """(label kind, its class names and templates) of the run's labels: ``key`` (the config key
    ``what``), or the source's main kind."""
    source = cfg.data.source
    spaces = train_label_kinds(cfg)
    if not spaces:
        hint = " without data.csv_label_key" if source == "csv" else ""
        raise NclipError(f"data.source {source}{hint} has no labels: the objective's labels need a labelled source "
                         f"({', '.join(BUILTIN_SOURCES)}, folder, or csv with data.csv_label_key)")
    key = key or MAIN_LABEL.get(source, USER_LABEL)
    if key not in spaces:
        raise NclipError(f"{what} {key!r} is not a label of data.source {source} (it has {', '.join(spaces)})")
    return key, spaces[key]


def tag_captions(cfg: RunConfig) -> tuple[TagCaptions, str] | None:
    """The tagging captions of the run (``data.tagging``) and the label kind they name; None: off."""
    t = cfg.data.tagging
    if not t.enabled:
        return None
    key, space = label_kind(cfg, t.label_key, "data.tagging.label_key")
    return TagCaptions.of(space, t.templates, cfg.seed), key


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
    from nclip.data.hierarchy import Hierarchy

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


def run_label_space(cfg: RunConfig) -> LabelSpace:
    """The :class:`LabelSpace` of the labels ``cfg``'s objective trains on: the classes of the kind its
    label request names (else the source's main kind), with the class similarity its
    ``hierarchy_request`` asks for. A one-line NclipError for a source without labels."""
    objective = plan_for(cfg)
    request = objective.label_request() or LabelRequest()
    kind, space = label_kind(cfg, request.key)  # one-line errors for unlabelled sources and unknown kinds
    classes = tuple(space.names)
    hierarchy = objective.hierarchy_request()
    similarity = class_similarity(cfg, hierarchy, kind, classes) if hierarchy is not None else None
    return LabelSpace(classes, similarity)


def label_space_for(cfg: RunConfig) -> LabelSpace | None:
    """What the trainer builds ``cfg``'s objective with: :func:`run_label_space`, or None when the
    objective needs none (``needs_label_space``) or asks for no labels in this run."""
    objective = plan_for(cfg)
    if not objective.needs_label_space or objective.label_request() is None:
        return None
    return run_label_space(cfg)
