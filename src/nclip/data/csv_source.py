"""Image–caption pairs listed in a CSV or TSV file (``data.source: csv``).

The file has a header row; ``data.csv_image_key`` names the image-path column and
``data.csv_caption_key`` the caption column (OpenCLIP's defaults, ``filepath`` and ``title``).
Relative image paths are resolved against the CSV file's directory. ``.tsv`` files (or files whose
header holds a tab) are tab-separated.

The dataset is map-style, so it runs under the trainer's step-indexed sampler like the built-in
datasets (exact resume by step). Images are decoded lazily; a row whose image is missing or does
not decode, or whose caption is empty, is replaced deterministically by the next good row and
counted, so every batch keeps its size (contrastive batches must be equal on every rank).
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

from nclip.config import RunConfig
from nclip.data.transforms import augment, to_tensor
from nclip.errors import NclipError

_AUG_STREAM = 0xA06
MAX_BAD_IN_A_ROW = 100


def read_rows(path: str | Path, image_key: str, caption_key: str) -> tuple[list[str], list[str]]:
    """(image paths resolved against the file's directory, captions) of a CSV/TSV file."""
    path = Path(path)
    if not path.is_file():
        raise NclipError(f"data.csv: file not found: {path}")
    try:
        with path.open(newline="", encoding="utf-8") as f:
            first = f.readline()
            f.seek(0)
            delimiter = "\t" if path.suffix.lower() == ".tsv" or "\t" in first else ","
            reader = csv.DictReader(f, delimiter=delimiter)
            columns = reader.fieldnames or []
            for key, what in ((image_key, "data.csv_image_key"), (caption_key, "data.csv_caption_key")):
                if key not in columns:
                    raise NclipError(f"{path}: no column {key!r} ({what}); columns: {', '.join(columns) or 'none'}")
            images, captions = [], []
            for row in reader:
                images.append(row[image_key] or "")
                captions.append(row[caption_key] or "")
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
    return images, captions


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
    """Row i → (augmented image [3, S, S], caption, [(path, reason) of rows skipped for it]).

    ``raw``: the un-augmented image instead (:func:`nclip.data.loader.view_source`), from which the
    collate function makes two views (CMSF)."""

    def __init__(self, cfg: RunConfig, raw: bool = False):
        d = cfg.data
        self.cfg, self.file, self.raw = cfg, d.csv, raw
        self.images, self.captions = read_rows(d.csv, d.csv_image_key, d.csv_caption_key)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        bad = []
        n = len(self.images)
        for attempt in range(min(MAX_BAD_IN_A_ROW, n)):
            row = (index + attempt) % n
            out = load_pair(self.images[row], self.captions[row])
            if isinstance(out, str):
                bad.append((f"{self.file} row {row + 2} ({self.images[row]})", out))
                continue
            image, caption = out
            if self.raw:
                from nclip.data.loader import csv_view_side, view_source

                return view_source(image, csv_view_side(self.cfg.data.image_size)), caption, bad
            aug = self.cfg.data.augment
            rng = np.random.default_rng([self.cfg.seed, _AUG_STREAM, index])
            crop = augment(image, self.cfg.data.image_size, aug, rng)
            return to_tensor(crop), caption, bad
        raise NclipError(f"{self.file}: {len(bad)} unusable rows in a row from row {index + 2} "
                         f"(e.g. {bad[0][0]}: {bad[0][1]})")
