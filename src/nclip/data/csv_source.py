"""Image–caption pairs listed in a CSV or TSV file (``data.source: csv``).

The file has a header row; ``data.csv_image_key`` names the image-path column and
``data.csv_caption_key`` the caption column (OpenCLIP's defaults, ``filepath`` and ``title``).
Relative image paths are resolved against the CSV file's directory. ``.tsv`` files (or files whose
header holds a tab) are tab-separated.

``data.csv_label_key`` names a class-label column (label kind ``label``): class ids are its
distinct values in sorted order, so the label-using objectives (CMSF's label constraints, xent)
and ``data.tagging`` (captions made from the class names) train on it.

The dataset is map-style, so it runs under the trainer's step-indexed sampler like the built-in
datasets (exact resume by step). Images are decoded lazily; a row whose image is missing or does
not decode, or whose caption is empty, is replaced deterministically by the next good row and
counted, so every batch keeps its size (contrastive batches must be equal on every rank): the policy
of every source, :mod:`nclip.data.bad_samples`.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

from nclip.config import RunConfig
from nclip.data.bad_samples import first_good
from nclip.data.transforms import augment, to_uint8_tensor
from nclip.errors import NclipError

_AUG_STREAM = 0xA06


def read_table(path: str | Path, image_key: str, columns: dict[str, str]) -> tuple[list[str], dict[str, list[str]]]:
    """(image paths resolved against the file's directory, {column: values}) of a CSV/TSV file;
    ``columns`` maps each wanted column to the config key that names it (for the error message)."""
    path = Path(path)
    if not path.is_file():
        raise NclipError(f"data.csv: file not found: {path}")
    try:
        with path.open(newline="", encoding="utf-8") as f:
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
                         "(relative paths are resolved against the CSV's directory)")
    return images, values


def read_rows(path: str | Path, image_key: str, caption_key: str) -> tuple[list[str], list[str]]:
    """(image paths resolved against the file's directory, captions) of a CSV/TSV file."""
    images, values = read_table(path, image_key, {caption_key: "data.csv_caption_key"})
    return images, values[caption_key]


def class_ids(path: str | Path, values: list[str], label_key: str) -> tuple[tuple[str, ...], np.ndarray]:
    """(class names, class id of every row [N]) of a label column: the names are its distinct
    values (stripped) in sorted order, so a class's id does not depend on the row order. A row
    without a label is an error (the label-using objectives need every row's)."""
    values = [v.strip() for v in values]
    if "" in values:
        raise NclipError(f"{path} row {values.index('') + 2}: no label in column {label_key!r} (data.csv_label_key)")
    names = tuple(sorted(set(values)))
    lookup = {name: c for c, name in enumerate(names)}
    return names, np.array([lookup[v] for v in values], dtype=np.int64)


def label_names(cfg: RunConfig) -> tuple[str, ...]:
    """The class names of the CSV's ``data.csv_label_key`` column (class id = position)."""
    d = cfg.data
    _, values = read_table(d.csv, d.csv_image_key, {d.csv_label_key: "data.csv_label_key"})
    return class_ids(d.csv, values[d.csv_label_key], d.csv_label_key)[0]


def load_pair(image_path: str, caption: str) -> tuple[np.ndarray, str] | str:
    """(image uint8 [H, W, 3], caption) or the reason the row is unusable."""
    caption = caption.strip()
    if not caption:
        return "empty caption"
    try:
        with Image.open(image_path) as img:
            return np.asarray(img.convert("RGB")), caption
    except FileNotFoundError:
        return "image not found"
    except Exception as e:  # PIL raises many types for corrupt or truncated files
        return f"image does not decode: {type(e).__name__}"


class CsvTrainPairs(Dataset):
    """Row i → (augmented image [3, S, S], caption, [(path, reason) of rows skipped for it], the row
    read). ``labels`` [N]: the class id of every row with ``data.csv_label_key`` (else None).

    ``raw``: the un-augmented image instead (uint8 [H, W, 3]), from which the collate function crops
    two views (:mod:`nclip.data.views`). With ``data.tagging`` the caption column is not read:
    the caption is made from the row's label by the loader (the class name stands in for it here)."""

    def __init__(self, cfg: RunConfig, raw: bool = False):
        d = cfg.data
        self.cfg, self.file, self.raw = cfg, d.csv, raw
        columns = {} if d.tagging.enabled else {d.csv_caption_key: "data.csv_caption_key"}
        if d.csv_label_key is not None:
            columns[d.csv_label_key] = "data.csv_label_key"
        self.images, values = read_table(d.csv, d.csv_image_key, columns)
        self.labels = None
        if d.csv_label_key is not None:
            names, self.labels = class_ids(d.csv, values[d.csv_label_key], d.csv_label_key)
        self.captions = ([names[c] for c in self.labels] if d.tagging.enabled
                         else values[d.csv_caption_key])

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        (image, caption), row, bad = first_good(index, len(self.images), self._read, self._where)
        if self.raw:
            return image, caption, bad, row
        aug = self.cfg.data.augment
        rng = np.random.default_rng([self.cfg.seed, _AUG_STREAM, index])
        crop = augment(image, self.cfg.data.image_size, aug, rng)
        return to_uint8_tensor(crop), caption, bad, row

    def _read(self, row: int) -> tuple[np.ndarray, str] | str:
        return load_pair(self.images[row], self.captions[row])

    def _where(self, row: int) -> str:
        return f"{self.file} row {row + 2} ({self.images[row]})"
