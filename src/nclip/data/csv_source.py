"""Image–caption pairs listed in a CSV/TSV or JSONL file (``data.source: csv``).

A CSV file has a header row; ``data.csv_image_key`` names the image-path column and
``data.csv_caption_key`` the caption column (OpenCLIP's defaults, ``filepath`` and ``title``).
``.tsv`` files (or files whose header holds a tab) are tab-separated. A ``.jsonl`` (or ``.ndjson``)
file holds one JSON object per line, with the same keys as fields. Relative image paths are
resolved against the file's directory.

Several captions per image (:mod:`nclip.data.captions`): a CSV cell split by
``data.caption_separator``, a JSONL caption field that is a list of strings; which of them a step
sees is ``data.caption_choice`` (applied by the loader).

``data.csv_label_key`` names a class-label column (label kind ``label``): class ids are its
distinct values in sorted order, so the label-using objectives (CMSF's label constraints, xent)
and ``data.tagging`` (captions made from the class names) train on it.

The dataset is map-style, so it runs under the trainer's step-indexed sampler like the built-in
datasets (exact resume by step). Images are decoded lazily; a row whose image is missing or does
not decode, or whose captions are all empty, is replaced deterministically by the next good row and
counted, so every batch keeps its size (contrastive batches must be equal on every rank): the policy
of every source, :mod:`nclip.data.bad_samples`.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import NamedTuple

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

from nclip.config import RunConfig
from nclip.data.bad_samples import first_good
from nclip.data.captions import check_separator_found, field_captions, split_text
from nclip.data.hard_negatives import row_negatives
from nclip.data.transforms import augment, to_uint8_tensor
from nclip.errors import NclipError
from nclip.jsonio import jsonl_objects

_AUG_STREAM = 0xA06
JSONL_SUFFIXES = (".jsonl", ".ndjson")


class Table(NamedTuple):
    """The rows of a CSV/TSV or JSONL ``file``: image paths resolved against the file's directory,
    ``values`` {column: value of every row} (a JSONL field may hold a list: captions), and the line
    of every JSONL row (None for a CSV: row i is on line i + 2, after the header)."""

    file: str
    images: list[str]
    values: dict[str, list]
    lines: list[int] | None

    def where(self, row: int) -> str:
        """Row ``row`` for a message: "FILE row 5" of a CSV (counting the header), "FILE line 5" of a JSONL."""
        return f"{self.file} row {row + 2}" if self.lines is None else f"{self.file} line {self.lines[row]}"


def is_jsonl(path: str | Path) -> bool:
    return Path(path).suffix.lower() in JSONL_SUFFIXES


def read_table(path: str | Path, image_key: str, columns: dict[str, str]) -> Table:
    """The :class:`Table` of a CSV/TSV or JSONL file; ``columns`` maps each wanted column to the config
    key that names it (for the error message)."""
    file, path = str(path), Path(path)
    if not path.is_file():
        raise NclipError(f"data.csv: file not found: {path}")
    try:
        with path.open(newline="", encoding="utf-8") as f:
            images, values, lines = (_jsonl_rows if is_jsonl(path) else _csv_rows)(f, path, image_key, columns)
    except UnicodeDecodeError as e:
        raise NclipError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except csv.Error as e:
        raise NclipError(f"{path}: malformed CSV: {e}") from None
    if not images:
        raise NclipError(f"{path}: no rows (the dataset is empty)")
    root = path.parent
    images = [str(p if Path(p).is_absolute() else root / p) for p in images]
    probe = images[: min(len(images), 20)]
    if not any(Path(p).is_file() for p in probe):
        raise NclipError(f"{path}: none of the first {len(probe)} images exist, e.g. {probe[0]} "
                         "(relative paths are resolved against the file's directory)")
    return Table(file, images, values, lines)


def _csv_rows(f, path: Path, image_key: str, columns: dict[str, str]):
    first = f.readline()
    f.seek(0)
    delimiter = "\t" if path.suffix.lower() == ".tsv" or "\t" in first else ","
    reader = csv.DictReader(f, delimiter=delimiter)
    found = reader.fieldnames or []
    for key, what in ((image_key, "data.csv_image_key"), *columns.items()):
        if key not in found:
            raise NclipError(f"{path}: no column {key!r} ({what}); columns: {', '.join(found) or 'none'}; "
                             f"name yours with --set {what}=COLUMN")
    images, values = [], {key: [] for key in columns}
    for row in reader:
        images.append(row[image_key] or "")
        for key in columns:
            values[key].append(row[key] or "")
    return images, values, None


def _jsonl_rows(f, path: Path, image_key: str, columns: dict[str, str]):
    """A JSONL file's rows: every non-blank line an object with the image field (a string) and the
    wanted fields, their values as they are (a caption may be a list, a label a number)."""
    images, values, lines = [], {key: [] for key in columns}, []
    for n, row in jsonl_objects(f, path):
        here = f"{path} line {n}"
        for key, what in ((image_key, "data.csv_image_key"), *columns.items()):
            if key not in row:
                raise NclipError(f"{here}: no field {key!r} ({what}); fields: {', '.join(row) or 'none'}; "
                                 f"name yours with --set {what}=FIELD")
        if not isinstance(row[image_key], str):
            raise NclipError(f"{here}: the image field {image_key!r} must be a string (a path)")
        images.append(row[image_key])
        for key in columns:
            values[key].append(row[key])
        lines.append(n)
    return images, values, lines


def read_rows(path: str | Path, image_key: str, caption_key: str) -> tuple[list[str], list]:
    """(image paths resolved against the file's directory, each row's caption value: a CSV cell, a
    JSONL string or list) of a CSV/TSV or JSONL file."""
    table = read_table(path, image_key, {caption_key: "data.csv_caption_key"})
    return table.images, table.values[caption_key]


def row_captions(path: str | Path, table: Table, caption_key: str, separator: str | None,
                 negative_key: str | None = None) -> list[tuple[str, ...]]:
    """Every row's captions (:mod:`nclip.data.captions`): a CSV cell split by ``separator``, a JSONL
    field's string (split alike) or list of strings; an empty tuple for a row without a caption. The
    separator must be found in the captions or in the hard negatives' column ``negative_key`` (one
    caption and several negatives per image)."""
    cells = table.values[caption_key]
    also = table.values[negative_key] if negative_key is not None else []
    check_separator_found([*cells, *also], separator, f"{path} column {caption_key!r}")
    if not is_jsonl(path):
        return [split_text(cell, separator) for cell in cells]
    return [field_captions(cell, separator, f"{table.where(row)}: field {caption_key!r}")
            for row, cell in enumerate(cells)]


def class_ids(table: Table, values: list, label_key: str) -> tuple[tuple[str, ...], np.ndarray]:
    """(class names, class id of every row [N]) of a label column: the names are its distinct
    values (stripped; a JSONL number's text) in sorted order, so a class's id does not depend on the
    row order. A row without a label is an error (the label-using objectives need every row's)."""
    values = [str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for v in values]  # JSONL
    if any(not isinstance(v, str) for v in values):
        row = next(i for i, v in enumerate(values) if not isinstance(v, str))
        raise NclipError(f"{table.where(row)}: the label {label_key!r} (data.csv_label_key) must be a string "
                         "or a number")
    values = [v.strip() for v in values]
    if "" in values:
        raise NclipError(f"{table.where(values.index(''))}: no label in column {label_key!r} (data.csv_label_key)")
    names = tuple(sorted(set(values)))
    lookup = {name: c for c, name in enumerate(names)}
    return names, np.array([lookup[v] for v in values], dtype=np.int64)


def label_names(cfg: RunConfig) -> tuple[str, ...]:
    """The class names of the file's ``data.csv_label_key`` column (class id = position)."""
    d = cfg.data
    table = read_table(d.csv, d.csv_image_key, {d.csv_label_key: "data.csv_label_key"})
    return class_ids(table, table.values[d.csv_label_key], d.csv_label_key)[0]


def load_pair(image_path: str, captions: tuple[str, ...] | str) -> tuple[np.ndarray, tuple[str, ...] | str] | str:
    """(image uint8 [H, W, 3], the captions as given, a caption stripped) or the reason the row is
    unusable."""
    if isinstance(captions, str):
        captions = captions.strip()
    if not captions:
        return "empty caption"
    try:
        with Image.open(image_path) as img:
            return np.asarray(img.convert("RGB")), captions
    except FileNotFoundError:
        return "image not found"
    except Exception as e:  # PIL raises many types for corrupt or truncated files
        return f"image does not decode: {type(e).__name__}"


class CsvTrainPairs(Dataset):
    """Row i → (augmented image [3, S, S], the row's captions (a tuple: :mod:`nclip.data.captions`),
    [(path, reason) of rows skipped for it], the row read). ``labels`` [N]: the class id of every row
    with ``data.csv_label_key`` (else None). ``caption_sets``: every row's captions; ``captions``: its
    first one, the caption of the readers that take one per image (the frozen teachers, ProtoCLIP's
    episodic trainer); ``slots``: the most captions of any row. With ``data.hard_negative_key``,
    ``negative_sets``: every row's negatives (:mod:`nclip.data.hard_negatives`), ``negative_slots``: the
    most of any row (else None and 0).

    ``raw``: the un-augmented image instead (uint8 [H, W, 3]), from which the collate function crops
    two views (:mod:`nclip.data.views`). With ``data.tagging`` the caption column is not read:
    the caption is made from the row's label by the loader (the class name stands in for it here)."""

    def __init__(self, cfg: RunConfig, raw: bool = False):
        d = cfg.data
        self.cfg, self.file, self.raw = cfg, d.csv, raw
        columns = {} if d.tagging.enabled else {d.csv_caption_key: "data.csv_caption_key"}
        if d.csv_label_key is not None:
            columns[d.csv_label_key] = "data.csv_label_key"
        if d.hard_negative_key is not None:
            columns[d.hard_negative_key] = "data.hard_negative_key"
        table = read_table(d.csv, d.csv_image_key, columns)
        self.images, self.table = table.images, table._replace(values={})  # row positions, for messages
        self.labels = None
        if d.csv_label_key is not None:
            names, self.labels = class_ids(table, table.values[d.csv_label_key], d.csv_label_key)
        self.caption_sets = ([(names[c],) for c in self.labels] if d.tagging.enabled
                             else row_captions(d.csv, table, d.csv_caption_key, d.caption_separator,
                                               d.hard_negative_key))
        self.captions = [c[0] if c else "" for c in self.caption_sets]
        self.slots = max(len(c) for c in self.caption_sets)
        self.negative_sets, self.negative_slots = None, 0
        if d.hard_negative_key is not None:
            self.negative_sets = row_negatives(table, d.hard_negative_key, d.caption_separator, is_jsonl(d.csv))
            self.negative_slots = max(len(n) for n in self.negative_sets)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        (image, captions), row, bad = first_good(index, len(self.images), self._read, self._where)
        if self.raw:
            return image, captions, bad, row
        aug = self.cfg.data.augment
        rng = np.random.default_rng([self.cfg.seed, _AUG_STREAM, index])
        crop = augment(image, self.cfg.data.image_size, aug, rng)
        return to_uint8_tensor(crop), captions, bad, row

    def _read(self, row: int) -> tuple[np.ndarray, tuple[str, ...]] | str:
        return load_pair(self.images[row], self.caption_sets[row])

    def _where(self, row: int) -> str:
        return f"{self.table.where(row)} ({self.images[row]})"
