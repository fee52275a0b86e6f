"""Synthetic scenes: procedural image–caption pairs, the default training data (no download).

Each sample is a small RGB picture of 1 to ``max_objects`` flat-coloured shapes on a textured
low-contrast background, with

* ``captions``: 2–3 *faithful* reference captions, each a different paraphrase (a list of the
  objects, a counted grouping such as "two red stars and a blue circle", or a spatial relation
  such as "a red star left of a blue circle"); they are used for retrieval evaluation;
* ``caption``: the training caption. With probability ``loose_caption_prob`` it is *loose*: it
  mentions only some objects, only the realm of the main shape ("some curved shapes") or only a
  colour, like the weak image–text correlation of web data. Otherwise it is one of ``captions``.
  So ``sample.caption not in sample.captions`` exactly when the caption is loose.
* labels of the *main* object (the one with most visible pixels, ties to the first drawn),
  the set of shapes and colours present, and per-object visible-pixel masks.

Sample ``i`` of a split is a pure function of ``(seed, split, i, image_size, max_objects,
loose_caption_prob, hard_negative_group)``: it is drawn from ``numpy.random.default_rng([seed, salt, split_id, i])``,
so any length works, nothing is stored, and the three splits use disjoint random streams. The
image does not depend on ``loose_caption_prob`` (the caption draws come after the image draws).

``sts_pairs`` builds caption pairs with a graded similarity for a text STS evaluation.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from nclip.data.synthetic.captions import (
    INVERSE,
    RELATION_WORDS,
    indefinite_article,
    loose_caption,
    plural,
    reference_captions,
)
from nclip.data.synthetic.picker import Picker
from nclip.data.synthetic.render import Grid, layout, render
from nclip.data.synthetic.shapes import BACKGROUNDS, COLOURS, COUNT_NAMES, REALMS, SHAPE_REALM, SHAPES, SIZES
from nclip.data.types import LabelSpace, Sample

SPLITS: tuple[str, ...] = ("train", "val", "test")
_SALT = 0x5C3E  # separates this generator's streams from other users of the same seed
_STS_SALT = 0x575
_GROUP_TAG = 0x6E  # the streams of hard-negative groups, apart from those of single samples


# ---------------------------------------------------------------------------------------------
# The dataset.
# ---------------------------------------------------------------------------------------------

SHAPE_TEMPLATES = ("a picture of a {}.", "a {} on a background.", "an image showing a {}.",
                   "a drawing of the {}.", "the {} in a picture.")
COLOUR_TEMPLATES = ("a picture of a {} shape.", "something {}.", "a {} object on a background.",
                    "the {} shape.")
COUNT_TEMPLATES = ("{} shapes.", "a picture of {} shapes.", "{} objects on a background.",
                   "an image with {} shapes.")
REALM_TEMPLATES = ("a picture of a {}.", "some {}s.", "a {} on a background.",
                   "an image with a {}.")
SIZE_TEMPLATES = ("a {} shape.", "a picture of a {} object.", "something {} on a background.",
                  "the {} thing.")


def _label_spaces(max_objects: int) -> dict[str, LabelSpace]:
    return {
        "shape": LabelSpace(SHAPES, SHAPE_TEMPLATES),
        "colour": LabelSpace(COLOURS, COLOUR_TEMPLATES),
        "count": LabelSpace(COUNT_NAMES[:max_objects], COUNT_TEMPLATES),
        "realm": LabelSpace(REALMS, REALM_TEMPLATES),
        "size": LabelSpace(SIZES, SIZE_TEMPLATES),
    }


def _check_int(name: str, value, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    return int(value)


class SyntheticScenes(Sequence):
    """Procedural scenes of coloured shapes with captions; see the module docstring.

    Args:
        split: "train", "val" or "test" (disjoint random streams).
        length: number of samples (any non-negative size; samples are generated on access).
        seed: non-negative integer; with ``split`` and the index it fixes each sample.
        image_size: side S of the square RGB images, >= 16.
        max_objects: objects per scene are uniform in [1, max_objects], max_objects in [1, 6].
        loose_caption_prob: share of training captions that are loose, in [0, 1].
        hard_negative_group: g >= 1. Samples g·j .. g·j + g - 1 form a group that shares the
            layout, colours, sizes, positions and background and differs only in the shapes
            (each drawn per sample), so in a batch of whole groups captions can only be matched
            to their images through the shape words. 1 (the default) makes samples independent.

    Items are ``Sample``s with image uint8 [S, S, 3]; labels {"shape", "colour", "count",
    "realm", "size"} of the main object (count = number of objects - 1); multilabels
    {"shape": bool [len(SHAPES)], "colour": bool [len(COLOURS)]} of all objects present;
    masks bool [n_objects, S, S] of visible pixels, in drawing order.
    """

    def __init__(self, split: str = "train", length: int = 10000, seed: int = 0,
                 image_size: int = 64, max_objects: int = 4, loose_caption_prob: float = 0.3,
                 hard_negative_group: int = 1):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        self.split = split
        self.length = _check_int("length", length, 0)
        self.seed = _check_int("seed", seed, 0)
        self.image_size = _check_int("image_size", image_size, 16)
        self.max_objects = _check_int("max_objects", max_objects, 1, len(COUNT_NAMES))
        if not isinstance(loose_caption_prob, (int, float)) or not 0 <= loose_caption_prob <= 1:
            raise ValueError(f"loose_caption_prob must be in [0, 1], got {loose_caption_prob!r}")
        self.loose_caption_prob = float(loose_caption_prob)
        self.hard_negative_group = _check_int("hard_negative_group", hard_negative_group, 1)
        self.label_spaces = _label_spaces(self.max_objects)
        coords = ((np.arange(self.image_size) + 0.5) / self.image_size - 0.5).astype(np.float32)
        self._grid = Grid(*np.meshgrid(coords, coords, indexing="xy"))

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.length))]
        i = operator.index(index)
        if i < 0:
            i += self.length
        if not 0 <= i < self.length:
            raise IndexError(f"index {index} out of range for {self.length} samples")
        return self._generate(i)

    def __repr__(self) -> str:
        return (f"SyntheticScenes(split={self.split!r}, length={self.length}, seed={self.seed}, "
                f"image_size={self.image_size}, max_objects={self.max_objects}, "
                f"loose_caption_prob={self.loose_caption_prob}, "
                f"hard_negative_group={self.hard_negative_group})")

    def _generate(self, i: int) -> Sample:
        split = SPLITS.index(self.split)
        rng = np.random.default_rng([self.seed, _SALT, split, i])
        side = self.image_size
        # Image first, captions after: the picture does not depend on the caption settings.
        pick = Picker(rng)  # scalar draws; array draws (positions, noise) come from rng
        if self.hard_negative_group == 1:
            scene_rng, scene_pick, shape_pick = rng, pick, None
        else:  # the group's stream draws the scene, this sample's stream only the shapes
            group = i // self.hard_negative_group
            scene_rng = np.random.default_rng([self.seed, _SALT, split, _GROUP_TAG, group])
            scene_pick, shape_pick = Picker(scene_rng), pick
        objs = layout(scene_rng, scene_pick, side, self.max_objects, shape_pick)
        bg_kind = scene_pick.index(len(BACKGROUNDS))
        image, objs, masks, counts = render(scene_rng, scene_pick, objs, bg_kind, self._grid)
        main = int(counts.argmax())  # most visible pixels; argmax breaks ties to the first drawn

        captions = reference_captions(objs, main, pick, BACKGROUNDS[bg_kind], side)
        if pick.chance(self.loose_caption_prob):
            caption = loose_caption(objs, main, pick)
        else:
            caption = pick.choice(captions)

        m = objs[main]
        shapes_present = np.zeros(len(SHAPES), dtype=bool)
        shapes_present[[o.shape for o in objs]] = True
        colours_present = np.zeros(len(COLOURS), dtype=bool)
        colours_present[[o.colour for o in objs]] = True
        return Sample(
            image=image,
            caption=caption,
            captions=captions,
            labels={"shape": m.shape, "colour": m.colour, "count": len(objs) - 1,
                    "realm": SHAPE_REALM[m.shape], "size": m.size},
            multilabels={"shape": shapes_present, "colour": colours_present},
            masks=masks,
        )


# ---------------------------------------------------------------------------------------------
# Text similarity pairs (STS) from the same grammar.
# ---------------------------------------------------------------------------------------------


class _Group(NamedTuple):
    shape: int
    colour: int
    count: int  # >= 1


class _Description(NamedTuple):
    first: _Group
    relation: str | None  # relation of first to second, None for a single group
    second: _Group | None


# Weights of the attributes compared by the STS score: shapes count most, then colours.
_STS_WEIGHTS = {"shape": 2.0, "realm": 1.0, "colour": 1.5, "count": 1.0}
_STS_RELATION_WEIGHT = 1.0


def _random_group(pick: Picker) -> _Group:
    return _Group(pick.index(len(SHAPES)), pick.index(len(COLOURS)), 1 + pick.index(3))


def _random_description(pick: Picker) -> _Description:
    if pick.chance(0.3):
        return _Description(_random_group(pick), None, None)
    return _Description(_random_group(pick), pick.choice(tuple(INVERSE)), _random_group(pick))


def _mutate(desc: _Description, pick: Picker, p: float) -> _Description:
    """Re-draw each attribute of ``desc`` with probability p (p = 0 keeps it)."""
    def group(g: _Group) -> _Group:
        shape = pick.index(len(SHAPES)) if pick.chance(p) else g.shape
        colour = pick.index(len(COLOURS)) if pick.chance(p) else g.colour
        count = 1 + pick.index(3) if pick.chance(p) else g.count
        return _Group(shape, colour, count)

    if pick.chance(p / 2):  # change the structure: add or drop the second group
        if desc.second is None:
            return _Description(group(desc.first), pick.choice(tuple(INVERSE)),
                                _random_group(pick))
        return _Description(group(desc.first), None, None)
    if desc.second is None:
        return _Description(group(desc.first), None, None)
    relation = pick.choice(tuple(INVERSE)) if pick.chance(p) else desc.relation
    return _Description(group(desc.first), relation, group(desc.second))


def _group_match(a: _Group | None, b: _Group | None) -> float:
    """Weighted number of shared attributes of two groups (both absent: all shared)."""
    if a is None or b is None:
        return sum(_STS_WEIGHTS.values()) if a is b else 0.0
    same = {"shape": a.shape == b.shape, "realm": SHAPE_REALM[a.shape] == SHAPE_REALM[b.shape],
            "colour": a.colour == b.colour, "count": a.count == b.count}
    return sum(w for key, w in _STS_WEIGHTS.items() if same[key])


def _flip(d: _Description) -> _Description:
    """The same meaning said from the second group's side."""
    if d.second is None:
        return d
    return _Description(d.second, INVERSE[d.relation], d.first)


def _sts_similarity(a: _Description, b: _Description) -> float:
    """Graded similarity in [0, 5]: 5 x the weighted share of attributes in common.

    Attributes: shape, realm, colour and count of each group, and the relation. "X left of Y"
    and "Y right of X" say the same thing, so the best reading counts (both ways round, so a
    single group may match either group of a pair, and the score is symmetric).
    """
    total = 2 * sum(_STS_WEIGHTS.values()) + _STS_RELATION_WEIGHT

    def raw(x: _Description, y: _Description) -> float:
        rel = _STS_RELATION_WEIGHT if x.relation == y.relation else 0.0
        return _group_match(x.first, y.first) + _group_match(x.second, y.second) + rel

    return 5.0 * max(raw(a, b), raw(a, _flip(b)), raw(_flip(a), b)) / total


def _group_text(g: _Group) -> str:
    if g.count == 1:
        return f"{indefinite_article(COLOURS[g.colour])} {COLOURS[g.colour]} {SHAPES[g.shape]}"
    return f"{COUNT_NAMES[g.count - 1]} {COLOURS[g.colour]} {plural(SHAPES[g.shape])}"


_STS_TEMPLATES = ("{}.", "a picture of {}.", "an image with {}.", "we see {}.")


def _describe(d: _Description, pick: Picker) -> str:
    """Caption of a description, in a random paraphrase (relation possibly said backwards)."""
    if d.second is None:
        core = _group_text(d.first)
    else:
        if pick.chance(0.3):
            d = _flip(d)
        core = f"{_group_text(d.first)} {pick.choice(RELATION_WORDS[d.relation])} " \
               f"{_group_text(d.second)}"
    return pick.choice(_STS_TEMPLATES).format(core)


def sts_pairs(n: int, seed: int = 0) -> list[tuple[str, str, float]]:
    """``n`` caption pairs ``(text_a, text_b, score)`` with a graded similarity in [0, 5].

    The second caption describes a copy of the first scene whose attributes were re-drawn with a
    per-pair probability spread over [0, 1], so scores cover the whole range; about one pair in
    ten is an unchanged description (score 5.0), said in the same or another paraphrase.
    Deterministic in ``(n, seed)``; the first k pairs do not depend on n.
    """
    n = _check_int("n", n, 0)
    seed = _check_int("seed", seed, 0)
    pick = Picker(np.random.default_rng([seed, _STS_SALT]))
    pairs = []
    for _ in range(n):
        a = _random_description(pick)
        b = a if pick.chance(0.1) else _mutate(a, pick, pick.uniform())
        pairs.append((_describe(a, pick), _describe(b, pick), round(_sts_similarity(a, b), 4)))
    return pairs
