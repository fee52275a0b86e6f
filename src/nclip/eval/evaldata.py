"""The evaluation dataset record, :class:`EvalData`, and the name a dataset takes from its path:
what :mod:`nclip.eval.datasets` and the adapters it dispatches to (:mod:`nclip.eval.mask_folder`,
:mod:`nclip.eval.multilabel_file`) share, kept below them so that they do not import each other."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from nclip.data.types import LabelKind, Sample


@dataclass
class EvalData:
    """One evaluation dataset.

    name: the dataset part of the result keys (``zeroshot/<name>-<kind>/top1``).
    identity: JSON-able description that, with the split, identifies the extracted features
        (it keys the feature cache, so it must change whenever the data would).
    splits: "test" (zero-shot, retrieval, ...) and, for probes, "train".
    label_kinds: single-label kinds with their class names and prompt templates.
    retrieval: whether captions are real descriptions (image-text retrieval makes sense).
    multilabel_kinds: kinds with a multi-hot target (zero-shot multi-label).
    masks: whether samples carry object masks (mask probing).
    segment_space: the classes of the samples' ``mask_classes`` (zero-shot segmentation), or None.
    realm: (realm kind, class kind) for realm-wise probing, or None.
    realm_hierarchy: (class kind, Hierarchy) whose realms label the samples for realm-wise probing
        instead of ``realm`` (``nclip eval --hierarchy``, :func:`nclip.eval.realms.attach_hierarchies`).
    sts: sentence pairs (a, b, score) for text STS, or None.
    hard_negatives: every test sample's negative captions (``hardneg:FILE``, :mod:`nclip.eval.hardneg`),
        scored by the retrieval task, or None.
    split_dirs: the folder a split was read from, where it is not named by the split (an ImageFolder
        ``val/`` evaluated as the "test" split), for the log.
    """

    name: str
    identity: dict
    splits: dict[str, Sequence[Sample]] = field(default_factory=dict)
    label_kinds: dict[str, LabelKind] = field(default_factory=dict)
    retrieval: bool = False
    multilabel_kinds: tuple[str, ...] = ()
    masks: bool = False
    segment_space: LabelKind | None = None
    realm: tuple[str, str] | None = None
    realm_hierarchy: tuple[str, object] | None = None
    split_dirs: dict[str, str] = field(default_factory=dict)
    sts: list[tuple[str, str, float]] | None = None
    hard_negatives: list[tuple[str, ...]] | None = None


def dataset_name(path: Path) -> str:
    stem = path.resolve().name if path.is_dir() else path.stem
    clean = "".join(ch if ch.isalnum() or ch in "_." else "_" for ch in stem.lower()).strip("_")
    return clean or "data"
