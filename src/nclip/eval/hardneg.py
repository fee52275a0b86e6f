"""Hard negative evaluation (``hardneg:FILE``, SugarCrepe / ARO style): is an image's true caption
scored above every one of its negative captions by the model's zero-shot score?

The file holds one row per test item: an image, its true caption and one or more negative captions
(an image may appear in several rows, as SugarCrepe's does). A CSV/TSV has a header with an image
column (``image``, ``filepath``, ... or the run's ``data.csv_image_key``), a caption column (``caption``
or the run's ``data.csv_caption_key``) and the negatives: the run's ``data.hard_negative_key`` column
where the file has it, split by its ``data.caption_separator`` so that a training file evaluates as it
is, else every column whose name starts with ``negative`` (one negative per cell). A JSONL row has the
same fields (its caption may be ``captions``, as :func:`nclip.data.tools.write_pairs` writes it), its
caption and its ``negatives`` (or ``negative``, or the run's key) each a string or a list of strings,
as a training file's are. Image paths are relative to the file's folder. A row without a
caption or without a negative is a one-line error naming the file and the line.

The score is ``retrieval/<name>/hardneg_top1``: the share of rows whose best true caption (a row's
caption cell may hold several, split by the run's separator) scores above all of its negatives, a
tie counting as wrong; ``hardneg_rows`` is the number of rows.
"""

from __future__ import annotations

import csv
from pathlib import Path

import torch

from nclip.data.captions import field_captions, split_text
from nclip.data.folders import FileSamples, fingerprint
from nclip.errors import NclipError
from nclip.eval.evaldata import EvalData
from nclip.eval.evaldata import dataset_name as _dataset_name
from nclip.jsonio import jsonl_objects
from nclip.objectives.scores import Score

_IMAGE_KEYS = ("image", "image_path", "filepath", "file", "path")
# a JSONL's list of captions may be "captions", as nclip.data.tools.write_pairs writes it (a CSV's
# cell of them joined by a separator is split only as the run's own column)
_CAPTION_KEYS = ("caption", "captions")
_NEGATIVE_FIELDS = ("negatives", "negative")
_CHUNK = 512  # rows scored at once against their own negatives


def hardneg_file(path: str | Path, run_keys: tuple | None = None) -> EvalData:
    """The rows of a hard negative file (module docstring) as an :class:`EvalData` whose test split
    holds one sample per row (its image, its true captions) and whose ``hard_negatives`` are every
    row's negatives. ``run_keys``: the run's (image key, caption key, separator, hard negative key)
    (``DataConfig.caption_keys``)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise NclipError(f"hard negative file not found: {path}")
    run_image, run_caption, separator, run_negative = (tuple(run_keys or ()) + (None,) * 4)[:4]
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        rows = list(_jsonl_rows(path, run_image, run_caption, run_negative))
    elif suffix in (".csv", ".tsv"):
        rows = list(_csv_rows(path, run_image, run_caption, run_negative))
    else:
        raise NclipError(f"{path}: hard negatives must be a .csv, .tsv or .jsonl file")
    if not rows:
        raise NclipError(f"{path}: no rows")
    images, captions, negatives, where = [], [], [], []
    for line, image, caption, negs, split_caption, split_negatives in rows:
        here = f"{path} line {line}"
        image_path = Path(str(image).strip()).expanduser() if isinstance(image, str) and image.strip() else None
        if image_path is None:
            raise NclipError(f"{here}: missing image path")
        image_path = image_path if image_path.is_absolute() else path.parent / image_path
        if not image_path.is_file():
            raise NclipError(f"{here}: image not found: {image_path}")
        true = (field_captions(caption, separator if split_caption else None, here)
                if isinstance(caption, (str, list)) else ())
        if not true:
            raise NclipError(f"{here}: no caption")
        negs = _negatives(negs, separator if split_negatives else None, here)
        images.append(image_path)
        captions.append(true)
        negatives.append(negs)
        where.append(f"{here}: ")
    samples = FileSamples(images, captions, [{} for _ in images], where)
    return EvalData(name=_dataset_name(path), identity={"kind": "hardneg", "file": str(path.resolve()),
                                                        "files": fingerprint([path, *dict.fromkeys(images)])},
                    splits={"test": samples}, hard_negatives=negatives)


def _negatives(value, separator: str | None, where: str) -> tuple[str, ...]:
    """A row's negatives: the texts of cells or a JSON string or list, split by ``separator``."""
    values = value if isinstance(value, list) else [value]
    if any(not isinstance(v, str) for v in values):
        raise NclipError(f"{where}: the negatives must be strings")
    out = tuple(t for v in values for t in split_text(v, separator))
    if not out:
        raise NclipError(f"{where}: no negative caption")
    return out


def _csv_rows(path: Path, run_image, run_caption, run_negative):
    """(line, image, caption, negatives, whether the caption and the negatives are split by the run's
    separator: they are the run's own columns) of every CSV/TSV data row."""
    with path.open(encoding="utf-8", newline="") as fh:
        reader = csv.DictReader(fh, delimiter="\t" if path.suffix.lower() == ".tsv" else ",")
        header = [h.strip().lower() for h in (reader.fieldnames or [])]
        reader.fieldnames = header
        image = _pick(header, (_lower(run_image), *_IMAGE_KEYS))
        caption = _pick(header, (_lower(run_caption), "caption"))
        run_negative = run_negative.strip().lower() if run_negative else None
        # the run's own column holds several negatives split by its separator, even when its name
        # starts with "negative" too
        split_negatives = run_negative in header
        negative_columns = [run_negative] if split_negatives else [h for h in header if h.startswith("negative")]
        if image is None or caption is None or not negative_columns:
            got = ",".join(header) or "nothing"
            raise NclipError(f"{path} line 1: the header needs an image column ({'/'.join(_IMAGE_KEYS)}), a caption "
                             f"column (caption) and negative columns (negative...), got {got}")
        for row in reader:
            if None in row:
                raise NclipError(f"{path} line {reader.line_num}: more fields than the header has")
            negs = [row[k] for k in negative_columns if row.get(k)]
            yield (reader.line_num, row.get(image), row.get(caption), negs or "", caption == _lower(run_caption),
                   split_negatives)


def _jsonl_rows(path: Path, run_image, run_caption, run_negative):
    """(line, image, caption, negatives, whether the caption and the negatives are split by the run's
    separator) of every JSONL row."""
    with path.open(encoding="utf-8") as fh:
        for n, row in jsonl_objects(fh, path):
            image = _pick(list(row), (run_image, *_IMAGE_KEYS))
            caption = _pick(list(row), (run_caption, *_CAPTION_KEYS))
            negative = _pick(list(row), (*_NEGATIVE_FIELDS, run_negative))
            if negative is None:
                raise NclipError(f"{path} line {n}: no field 'negatives' (a string or a list of strings)")
            yield (n, row.get(image) if image else None, row.get(caption) if caption else None, row[negative],
                   caption == run_caption, negative == run_negative)


def _lower(key: str | None) -> str | None:
    return key.strip().lower() if key else None


def _pick(names: list[str], wanted) -> str | None:
    return next((k for k in wanted if k and k in names), None)


@torch.no_grad()
def evaluate(image: torch.Tensor, text: torch.Tensor, text_to_image: torch.Tensor, negatives: torch.Tensor,
             negative_to_row: torch.Tensor, score: Score) -> dict[str, float]:
    """``hardneg_top1`` (module docstring) of the rows' image outputs ``image`` [R, ...], their true
    captions' ``text`` [T, ...] (``text_to_image`` [T]: each caption's row) and their negatives'
    ``negatives`` [M, ...] (``negative_to_row`` [M]), the outputs of ``score``'s head, compared by it."""
    rows = image.shape[0]
    best_true = torch.full((rows,), float("-inf"))
    best_negative = torch.full((rows,), float("-inf"))
    for start in range(0, rows, _CHUNK):
        stop = min(start + _CHUNK, rows)
        for outputs, owner, best in ((text, text_to_image, best_true), (negatives, negative_to_row, best_negative)):
            mine = ((owner >= start) & (owner < stop)).nonzero().squeeze(1)
            scores = score.compare(image[start:stop], outputs[mine]).float().cpu()  # [chunk, its texts]
            own = scores[owner[mine] - start, torch.arange(len(mine))]
            best.scatter_reduce_(0, owner[mine].cpu(), own, reduce="amax")
    return {"hardneg_top1": float((best_true > best_negative).float().mean()), "hardneg_rows": float(rows)}
