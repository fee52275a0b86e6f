"""Several captions per image: reading them from a CSV cell, a JSONL field or a shard sample, and
choosing the ones a training step sees (``data.caption_choice``).

COCO and Flickr30k have five captions per image; a product catalogue has a title, a description
and tags. A row of a CSV/TSV holds them in one cell split by ``data.caption_separator``; a JSONL
row's caption field is a string or a list of strings; a WebDataset sample holds them as several
``.txt`` members (``KEY.txt``, ``KEY.1.txt``, ...) or as a list in a field of its ``.json``
(``data.json_caption_key``). Every caption is stripped, and empty ones are left out (an image with
none left is a bad sample, as an empty caption always was).

``data.caption_choice``:

- ``random`` (the default): one caption per image per step, drawn by a generator seeded with the
  run seed, the epoch of the step and the image's dataset index (a stream's record number for
  WebDataset, whose records carry no epoch), so a resumed run draws what an uninterrupted one drew,
  and the draw is the same whatever the number of loader workers and ranks. An image with one
  caption draws nothing: a one-caption source trains on exactly the batches it always did;
- ``first``: always the first caption;
- ``all``: every caption of an image, padded to ``slots`` per image; the batch then carries the
  token ids [B, C, L] and which slots hold a caption (``Batch.caption_valid`` [B, C]), for an
  objective that takes several positives per image (``Objective.several_captions``).
"""

from __future__ import annotations

import numpy as np

from nclip.errors import NclipError

_CAPTION_STREAM = 0xCA7  # separates the caption draw from the other users of the seed


def split_text(text: str, separator: str | None) -> tuple[str, ...]:
    """The captions of one text: split by ``separator`` (None: the whole text), each stripped, the
    empty ones left out."""
    parts = [text] if separator is None else text.split(separator)
    return tuple(p for p in (part.strip() for part in parts) if p)


def field_captions(value, separator: str | None, where: str) -> tuple[str, ...]:
    """The captions of a JSON field (a JSONL row's): a string (split as :func:`split_text` does) or a
    list of strings. A list that is empty or holds anything but strings is a one-line error: the file
    is malformed, whereas an empty string is an empty caption (a bad row, skipped like a CSV's)."""
    if isinstance(value, str):
        return split_text(value, separator)
    if (problem := list_problem(value)) is not None:
        raise NclipError(f"{where}: {problem}")
    return tuple(t for t in (v.strip() for v in value) if t)


def list_problem(value) -> str | None:
    """What is wrong with a JSON value that should be a list of captions, or None."""
    if not isinstance(value, list):
        return f"the caption must be a string or a list of strings, got {_kind(value)}"
    if not value:
        return "the caption list is empty"
    wrong = [v for v in value if not isinstance(v, str)]
    return f"the caption list holds {_kind(wrong[0])}; expected strings only" if wrong else None


def _kind(value) -> str:
    return "null" if value is None else f"{str(value)[:40]} ({type(value).__name__})"


def check_separator_found(texts, separator: str | None, what: str) -> None:
    """Refuse a ``data.caption_separator`` that no caption text of the column holds. Such a run would
    train on one caption per image, each the whole cell with the separator the user expected inside
    it, and never say so; a separator that splits some cells only is legitimate (images with one
    caption), one that splits none is a wrong separator or a wrong column."""
    if separator is None or any(separator in t for t in texts if isinstance(t, str)):
        return
    raise NclipError(f"{what}: data.caption_separator {separator!r} is found in no caption, so every image would "
                     "have one caption; name the separator the file uses, or leave it unset")


def choose(captions: tuple[str, ...], choice: str, seed_key: list[int]) -> str | tuple[str, ...]:
    """The caption(s) a training step sees of an image's ``captions`` (module docstring):
    ``seed_key`` seeds the draw of ``random`` (the run seed first, then what identifies the draw)."""
    if choice == "all":
        return captions
    if choice == "first" or len(captions) == 1:
        return captions[0]
    draw = np.random.default_rng([seed_key[0], _CAPTION_STREAM, *seed_key[1:]]).integers(len(captions))
    return captions[int(draw)]


def slot_rows(groups: list[tuple[str, ...]], slots: int) -> tuple[list[str], np.ndarray]:
    """(the captions of every image padded to ``slots`` with empty strings, flattened image by image;
    which slots hold a caption, bool [B, slots]) for ``caption_choice: all``. An image's captions
    beyond ``slots`` are left out, its first ones kept."""
    flat, valid = [], np.zeros((len(groups), slots), dtype=bool)
    for i, captions in enumerate(groups):
        kept = list(captions[:slots])
        valid[i, : len(kept)] = True
        flat += kept + [""] * (slots - len(kept))
    return flat, valid


def count_summary(counts: list[int]) -> dict | None:
    """{min, mean, max} of the captions per image (``nclip data inspect``); None without images."""
    if not counts:
        return None
    return {"min": min(counts), "mean": round(float(np.mean(counts)), 2), "max": max(counts)}
