"""Evaluation images that the run trained on: zero-shot or retrieval on a folder the
model saw in training measures memory, not transfer, and nothing said so. Found by path, for runs
trained on a ``folder`` or ``csv`` source (the sources whose rows are files); one warning a dataset."""

from __future__ import annotations

import os
from pathlib import Path

from nclip.errors import NclipError


def trained_paths(cfg) -> tuple[set[str], str] | None:
    """(the resolved paths of the run's training images, their source as the config names it), or
    None for sources without files, or when the training data is no longer readable."""
    d = cfg.data
    try:
        if d.source == "folder":
            from nclip.data.folders import folder_train_samples

            return {_key(p) for p in folder_train_samples(d.folder).paths}, f"data.folder {d.folder}"
        if d.source == "csv":
            from nclip.data.csv_source import CsvTrainPairs

            return {_key(p) for p in CsvTrainPairs(cfg).images}, f"data.csv {d.csv}"
    except (NclipError, OSError):  # moved or deleted since training: nothing to compare with
        return None
    return None


def overlap_warning(data, trained: tuple[set[str], str] | None) -> str | None:
    """A one-line warning when test images of ``data`` (an EvalData) are training images, else None."""
    paths = getattr(data.splits.get("test"), "paths", None)
    if trained is None or not paths:
        return None
    seen, source = trained
    shared = sum(_key(p) in seen for p in paths)
    if not shared:
        return None
    return (f"{shared} of the {len(paths)} test images of {data.name} are images this run trained on ({source}): "
            "their zero-shot, retrieval and probe numbers are not held-out results")


def _key(path) -> str:
    return os.path.realpath(Path(str(path)).expanduser())
