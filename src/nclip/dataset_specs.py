"""The grammar of a dataset spec (``nclip eval --dataset``, suites, ``train.eval_datasets``,
``nclip finetune``): the one table of dataset kinds, and the parsing and checking of a spec.

A spec is a built-in dataset's name (``synthetic``, ``digits``) or ``KIND:PATH``. The table says,
per kind, how a spec of it is written, what it holds (the CLI's help text is made from it) and
which of the user's prompt files (``--classnames``, ``--templates``) it takes. It sits in layer 0,
imports nothing heavier than :mod:`nclip.errors`, so that the run config (layer 2) and evaluation
(layer 5) check specs with the same grammar without importing upward, and so that a mistyped spec
fails when a config is read, not hours into a run. Building the data of each kind is
:mod:`nclip.eval.datasets`' job: its builders are keyed by the same names.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from nclip.defaults import BUILTIN_SOURCES
from nclip.errors import NclipError

CLASSNAMES, TEMPLATES = "classnames", "templates"  # the user's prompt files a kind may take


@dataclass(frozen=True)
class DatasetKind:
    """One kind of evaluation dataset: ``syntax`` is its spec as the help shows it, ``summary`` what
    it holds (a few words, for the help), ``prompts`` which prompt files apply to its classes."""

    name: str
    syntax: str
    summary: str
    prompts: frozenset[str] = frozenset()

    @property
    def takes_path(self) -> bool:
        """A ``KIND:PATH`` spec; the built-in datasets take no argument."""
        return self.name not in BUILTIN_SOURCES


_BOTH = frozenset({CLASSNAMES, TEMPLATES})

DATASET_KINDS: dict[str, DatasetKind] = {kind.name: kind for kind in (
    DatasetKind("synthetic", "synthetic", "built-in synthetic scenes"),
    DatasetKind("digits", "digits", "scikit-learn's 8x8 digits"),
    DatasetKind("folder", "folder:DIR", "class folders", _BOTH),
    DatasetKind("realms", "realms:DIR", "realm/class folders", frozenset({TEMPLATES})),
    DatasetKind("captions", "captions:FILE.csv|.jsonl", "image-caption retrieval"),
    DatasetKind("hardneg", "hardneg:FILE.csv|.jsonl", "a caption against its hard negatives"),
    DatasetKind("sts", "sts:FILE.csv", "sentence similarity"),
    DatasetKind("multilabel", "multilabel:FILE.csv", "zero-shot multi-label", _BOTH),
    DatasetKind("masks", "masks:DIR", "object masks, VOC layout", frozenset({TEMPLATES})),
    DatasetKind("wds", "wds:DIR[:SPLIT]", "CLIP_benchmark's WebDataset copy", _BOTH),
    DatasetKind("imagefolder", "imagefolder:SPLIT_DIR", "one ImageFolder split", _BOTH),
    DatasetKind("karpathy", "karpathy:FILE.json:IMAGES_DIR[:SPLIT]", "COCO / Flickr30k Karpathy split"),
)}
BUILTIN_KINDS = tuple(name for name, kind in DATASET_KINDS.items() if not kind.takes_path)
PATH_KINDS = tuple(name for name, kind in DATASET_KINDS.items() if kind.takes_path)


def kinds_taking(prompt_file: str) -> tuple[str, ...]:
    """The kinds whose classes ``prompt_file`` (:data:`CLASSNAMES` or :data:`TEMPLATES`) applies to."""
    return tuple(name for name, kind in DATASET_KINDS.items() if prompt_file in kind.prompts)


def spec_help() -> str:
    """The spec grammar as one line of help text: every kind's syntax, with its summary."""
    return " | ".join(f"{kind.syntax} ({kind.summary})" for kind in DATASET_KINDS.values())


def parse_spec(spec: str) -> tuple[str, str | None]:
    """``"synthetic"`` -> ("synthetic", None); ``"folder:/data/pets"`` -> ("folder", "/data/pets")."""
    name, sep, arg = spec.partition(":")
    name = name.strip().lower()
    kind = DATASET_KINDS.get(name)
    if kind is not None and not kind.takes_path and not sep:
        return name, None
    if kind is not None and kind.takes_path and sep and arg.strip():
        return name, os.path.expanduser(arg.strip())
    raise NclipError(
        f"unknown dataset {spec!r}; use one of {', '.join(BUILTIN_KINDS)} or KIND:PATH "
        f"with KIND in {', '.join(PATH_KINDS)}"
    )


def checked_spec(spec: str) -> str:
    """``spec`` if :func:`parse_spec` accepts it, else its one-line message as a ValueError (for the
    pydantic validators of every config that names datasets: ``nclip eval``, suites, ``train.eval_datasets``)."""
    try:
        parse_spec(spec)
    except NclipError as e:
        raise ValueError(str(e)) from None
    return spec
