"""The user's multi-label data (``nclip eval --dataset multilabel:FILE.csv``) for zero-shot
multi-label classification (xCLIP Tab. 3; :mod:`nclip.eval.multilabel`).

The file is a CSV (a ``.tsv``: tab-separated) with a header row and two columns: the image path,
relative to the file's folder (or absolute), and the image's labels separated by ``;``::

    image,labels
    photos/0001.jpg,dog;grass;frisbee
    photos/0002.jpg,cat

The classes are the distinct labels, sorted; a class's name in the prompts is the label with ``_``
and ``-`` as spaces, or the name ``--classnames`` gives it (:mod:`nclip.eval.prompts`). A row with
another number of columns, no labels or a missing image is a one-line error naming ``FILE:LINE``.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from nclip.data.folders import FOLDER_TEMPLATES, FileSamples, class_name, fingerprint
from nclip.data.types import LabelKind
from nclip.errors import NclipError
from nclip.eval import prompts
from nclip.eval.evaldata import EvalData, dataset_name

KIND = "label"  # result keys: multilabel/<file stem>-label/<metric>


class MultiLabelSamples(FileSamples):
    """Images read on access, each with its multi-hot target ``multilabels[KIND]`` (bool [C])."""

    def __init__(self, paths: list[Path], targets: np.ndarray, names: tuple[str, ...], where: list[str]):
        captions = [(", ".join(names[c] for c in np.flatnonzero(t)),) for t in targets]
        super().__init__(paths, captions, [{} for _ in paths], where)
        self.targets = targets  # bool [N, C]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return super().__getitem__(i)
        sample = super().__getitem__(i)
        sample.multilabels = {KIND: self.targets[i]}
        return sample


def read_rows(path: Path) -> list[tuple[Path, list[str], str]]:
    """(image, labels, "FILE:LINE") of every data row of a multi-label CSV, checked."""
    rows = []
    with path.open(encoding="utf-8", newline="") as fh:
        reader = csv.reader(fh, delimiter="\t" if path.suffix.lower() == ".tsv" else ",")
        header = next(reader, None)
        if header is None or len(header) != 2:
            raise NclipError(f"{path}:1: expected a header row of 2 columns (image path, ';'-separated labels), "
                             f"got {len(header or [])}")
        for row in reader:
            where = f"{path}:{reader.line_num}"
            if not row or not any(cell.strip() for cell in row):
                continue  # a blank line
            if len(row) != 2:
                raise NclipError(f"{where}: expected 2 columns (image path, ';'-separated labels), got {len(row)}")
            image, labels = row[0].strip(), [lab.strip() for lab in row[1].split(";") if lab.strip()]
            if not image:
                raise NclipError(f"{where}: missing image path")
            img = Path(image).expanduser()
            img = img if img.is_absolute() else path.parent / img
            if not img.is_file():
                raise NclipError(f"{where}: image not found: {img}")
            if not labels:
                raise NclipError(f"{where}: no labels (give them ';'-separated in the second column)")
            rows.append((img, list(dict.fromkeys(labels)), where))
    return rows


def multilabel_file(path: str | Path, classnames: str | None = None, templates: str | None = None) -> EvalData:
    """The multi-label test set of a CSV (see the module docstring), label kind :data:`KIND`."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise NclipError(f"multi-label file not found: {path}")
    if path.suffix.lower() not in (".csv", ".tsv"):
        raise NclipError(f"{path}: multi-label data must be a .csv or .tsv file")
    rows = read_rows(path)
    labels = sorted({lab for _, labs, _ in rows for lab in labs})
    if len(labels) < 2:
        raise NclipError(f"{path}: multi-label classification needs at least 2 distinct labels, found {len(labels)}")
    index = {lab: c for c, lab in enumerate(labels)}
    targets = np.zeros((len(rows), len(labels)), dtype=bool)
    for n, (_, labs, _) in enumerate(rows):
        targets[n, [index[lab] for lab in labs]] = True
    names = prompts.class_names(classnames, labels, [class_name(lab) for lab in labels], "label")
    space = LabelKind(names, prompts.templates(templates, FOLDER_TEMPLATES))
    paths = [img for img, _, _ in rows]
    samples = MultiLabelSamples(paths, targets, names, [f"{where}: " for _, _, where in rows])
    return EvalData(name=dataset_name(path),
                    identity={"kind": "multilabel", "file": str(path.resolve()),
                              "files": fingerprint([path, *paths])},
                    splits={"test": samples}, label_kinds={KIND: space}, multilabel_kinds=(KIND,))
