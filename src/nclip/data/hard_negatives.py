"""Hard negative captions of an image (NegCLIP, Yuksekgonul et al. 2023): captions that almost match,
read from the user's file or made from the positive caption, and their place in a batch.

Two sources, one at a time:

- ``data.hard_negative_key``: a column of a CSV/TSV file (several negatives in a cell split by
  ``data.caption_separator``) or a field of a JSONL row (a string, split alike, or a list of
  strings) holding the image's own negatives. An empty cell is an image without negatives; an empty
  JSON list, or a column without a single negative, is a one-line error. In WebDataset shards it is
  a field of each sample's ``.json`` member, a string or a list of strings (:func:`record_negatives`):
  a stream is never read whole up front, so a sample without the field (or with null or an empty
  list) has no negatives, and one whose field is malformed is a bad sample, skipped and counted.
- ``data.hard_negatives: swap``: one negative per image made from the caption the step trains on
  (:func:`swap_caption`), for any source.

In a batch the negatives follow the captions in the text slots: ids and mask [B, C + N, L], the last
N slots the negatives, ``Batch.negative_valid`` [B, N] which of them hold one
(:mod:`nclip.objectives.hard_negatives`).
"""

from __future__ import annotations

import json
import re
from typing import Sequence

import numpy as np

from nclip.data.captions import field_captions, list_problem, slot_rows, split_text
from nclip.errors import NclipError

_SWAP_STREAM = 0x5A9  # separates the swap draws from the other users of the seed

# words that are no content of a caption: a swap of two of them changes little or nothing
_FUNCTION_WORDS = frozenset("""
a an the this that these those some any one two three four five six seven eight nine ten
of on in at to into onto and or but with without plus among between behind beside next near by for from
left right above below under over up down top bottom front back side is are was were be been being
it its there here where which who what image picture photo something somewhere other others another
as than then while each every both all no not nor so very
""".split())
# the words that open a noun phrase (determiners, numerals): the phrase's words up to the next function
# word are its attributes, then its noun (the last)
_OPENERS = frozenset("a an the this that these those some one two three four five six seven eight nine ten".split())
_TOKEN = re.compile(r"^(\W*)(.*?)(\W*)$")


def row_negatives(table, key: str, separator: str | None, jsonl: bool) -> list[tuple[str, ...]]:
    """Every row's negatives from the ``key`` column (``data.hard_negative_key``) of a read
    :class:`nclip.data.csv_source.Table`; one line if the column holds no negative at all."""
    cells = table.values[key]
    if jsonl:
        rows = [field_captions(cell, separator, f"{table.where(row)}: hard negatives {key!r}")
                for row, cell in enumerate(cells)]
    else:
        rows = [split_text(cell, separator) for cell in cells]
    if not any(rows):
        raise NclipError(f"{table.file}: the hard negative column {key!r} (data.hard_negative_key) holds no "
                         "negative caption")
    return rows


def record_negatives(parts: dict[str, bytes], key: str) -> tuple[str, ...] | str:
    """The negatives in the field ``key`` (``data.hard_negative_key``) of a shard sample's ``.json``
    member (``parts``: the sample's members by extension), or why the sample is bad (module docstring)."""
    if "json" not in parts:
        return ()
    try:
        meta = json.loads(parts["json"])
    except (ValueError, UnicodeDecodeError):
        return f"the .json member (data.hard_negative_key {key!r}) is not valid JSON"
    value = meta.get(key) if isinstance(meta, dict) else None
    if value is None or value == []:
        return ()
    value = [value] if isinstance(value, str) else value
    if (problem := list_problem(value)) is not None:
        return f"hard negatives {key!r}: {problem}"
    return tuple(t for t in (v.strip() for v in value) if t)


def swap_caption(caption: str, seed: int, index: int | Sequence[int]) -> str | None:
    """NegCLIP's swap negative of ``caption`` for the image at dataset index ``index`` (a stream's
    sample: the integers that identify its record): a pure function of (seed, index, caption), so that
    a resumed run, any number of workers and any number of ranks make the same.

    The candidates are the caption's attribute swaps (the attributes of two noun phrases with
    different attributes exchanged: "a red circle left of a blue square" → "a blue circle left of a
    red square") and its word-order swaps (two different content words exchanged: "... circle left of
    ... square" → "... square left of ... circle"). A generator seeded by (seed, index) picks the kind
    (attribute swaps when there are any, half the time) and then one swap of it. Words are whitespace
    tokens; punctuation and case stay where they were. None: no swap changes the caption (fewer than
    two different content words)."""
    words = caption.split()
    parts = [_TOKEN.match(w).groups() for w in words]
    cores = [core.lower() for _, core, _ in parts]
    content = [i for i, c in enumerate(cores) if c.isalpha() and c not in _FUNCTION_WORDS]
    word_swaps = [((i,), (j,)) for n, i in enumerate(content) for j in content[n + 1:] if cores[i] != cores[j]]
    phrases = _attribute_spans(cores)
    attribute_swaps = [(a, b) for n, a in enumerate(phrases) for b in phrases[n + 1:]
                       if [cores[k] for k in a] != [cores[k] for k in b]]
    if not word_swaps and not attribute_swaps:
        return None
    rng = np.random.default_rng([seed, _SWAP_STREAM, *np.atleast_1d(index).tolist()])
    kinds = [k for k in (attribute_swaps, word_swaps) if k]
    swaps = kinds[int(rng.integers(len(kinds)))]
    first, second = swaps[int(rng.integers(len(swaps)))]
    return _exchange(parts, first, second)


def _attribute_spans(cores: list[str]) -> list[tuple[int, ...]]:
    """The word positions of every noun phrase's attributes: after an opener, the content words up to
    the next function word or the caption's end, less the last (the noun)."""
    spans = []
    for i, word in enumerate(cores):
        if word not in _OPENERS:
            continue
        j = i + 1
        while j < len(cores) and cores[j].isalpha() and cores[j] not in _FUNCTION_WORDS:
            j += 1
        if j - (i + 1) >= 2:
            spans.append(tuple(range(i + 1, j - 1)))
    return spans


def _exchange(parts: list[tuple[str, str, str]], first: tuple[int, ...], second: tuple[int, ...]) -> str:
    """The caption with the cores of the words ``first`` and ``second`` (spans of positions, the first
    before the second) exchanged, each word's punctuation left in place."""
    cores = [core for _, core, _ in parts]
    a, b = [cores[k] for k in first], [cores[k] for k in second]
    merged = cores[:first[0]] + b + cores[first[-1] + 1:second[0]] + a + cores[second[-1] + 1:]
    if len(first) != len(second):  # spans of different lengths: punctuation stays with the surrounding words
        return " ".join(merged)
    return " ".join(f"{pre}{core}{post}" for (pre, _, post), core in zip(parts, merged))


def text_slots(captions: list, negatives: list[tuple[str, ...]], caption_slots: int | None,
               negative_slots: int) -> tuple[list[str], np.ndarray | None, np.ndarray]:
    """(every image's caption slots then its ``negative_slots`` negative slots, flattened image by image;
    which caption slots hold a caption [B, C], None with one caption per image; which negative slots
    hold a negative [B, N]). ``captions``: one caption per image, or tuples padded to
    ``caption_slots`` (``caption_choice: all``); an image's negatives beyond ``negative_slots`` are
    left out, its first ones kept."""
    if caption_slots is None:
        caption_rows, caption_valid, c = [[t] for t in captions], None, 1
    else:
        flat, caption_valid = slot_rows(captions, caption_slots)
        c = caption_slots
        caption_rows = [flat[i * c:(i + 1) * c] for i in range(len(captions))]
    flat_neg, negative_valid = slot_rows(negatives, negative_slots)
    n = negative_slots
    rows = [caption_rows[i] + flat_neg[i * n:(i + 1) * n] for i in range(len(captions))]
    return [t for row in rows for t in row], caption_valid, negative_valid
