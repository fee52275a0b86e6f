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

from nclip.data.synthetic.picker import Picker
from nclip.data.synthetic.render import Grid, Obj, layout, render
from nclip.data.synthetic.shapes import BACKGROUNDS, COLOURS, COUNT_NAMES, REALMS, SHAPE_REALM, SHAPES, SIZES
from nclip.data.types import LabelSpace, Sample

SPLITS: tuple[str, ...] = ("train", "val", "test")
_PLURAL = {"cross": "crosses"}  # every other noun takes a plain "s"
_SALT = 0x5C3E  # separates this generator's streams from other users of the same seed
_STS_SALT = 0x575
_GROUP_TAG = 0x6E  # the streams of hard-negative groups, apart from those of single samples


def _plural(noun: str) -> str:
    """English plural of a shape, realm or "shape" noun ("cross" -> "crosses")."""
    return _PLURAL.get(noun, noun + "s")


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


# ---------------------------------------------------------------------------------------------
# Caption grammar.
# ---------------------------------------------------------------------------------------------

_SIZE_WORDS = (("small", "small", "little"), ("large", "large", "big"))
# Relation of object a to object b, with paraphrases; the first is the canonical word.
_RELATION_WORDS = {
    "left of": ("left of", "to the left of"),
    "right of": ("right of", "to the right of"),
    "above": ("above", "above"),
    "below": ("below", "under"),
}
_INVERSE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
_LIST_TEMPLATES = ("a picture of {}.", "an image showing {}.", "{} on a {bg} background.",
                   "a drawing of {}.", "there is {}.", "{}.")
_COUNT_TEMPLATES = ("{n} {noun}: {}.", "a picture of {n} {noun}: {}.", "{}, {n} {noun} in total.",
                    "{n} {noun} on a {bg} background: {}.")
_RELATION_TEMPLATES = ("{}.", "a picture of {}.", "an image where {}.", "{} on a {bg} background.")
_LOOSE_REALM_TEMPLATES = ("a picture with {}.", "{} on a background.", "something with {}.",
                          "a scene with {}.")
_LOOSE_OBJECT_TEMPLATES = ("a picture with {}.", "an image that has {} in it.", "{} somewhere.",
                           "look, {}!")
_LOOSE_COLOUR_TEMPLATES = ("something {}.", "a picture with something {} in it.",
                           "a {} thing in a picture.")


def _join(items: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _phrase(obj: Obj, pick: Picker, size_word: bool = False, colour: bool = True,
            article: str | None = None) -> str:
    """Noun phrase of one object: 'a red star', 'the big red star', 'an ellipse'."""
    words = []
    if size_word:
        words.append(pick.choice(_SIZE_WORDS[obj.size]))
    if colour:
        words.append(COLOURS[obj.colour])
    words.append(SHAPES[obj.shape])
    return f"{article or _article(words[0])} {' '.join(words)}"


def _position(obj: Obj, side: int) -> str:
    """Where a single object sits, in thirds of the image: 'in the top left corner'."""
    col = min(int(3 * obj.cx / side), 2)
    row = min(int(3 * obj.cy / side), 2)
    horizontal, vertical = ("left", None, "right")[col], ("top", None, "bottom")[row]
    if horizontal and vertical:
        return f"in the {vertical} {horizontal} corner"
    if horizontal:
        return f"on the {horizontal}"
    if vertical:
        return f"at the {vertical}"
    return "in the centre"


def _relation(a: Obj, b: Obj) -> str:
    """Relation of a to b along the axis on which they are further apart (image y points down)."""
    dx, dy = b.cx - a.cx, b.cy - a.cy
    if abs(dx) >= abs(dy):
        return "left of" if dx > 0 else "right of"
    return "above" if dy > 0 else "below"


def _list_caption(objs: list[Obj], main: int, pick: Picker, bg: str) -> str:
    """'a picture of a large red star and a small blue circle.' (main object first)."""
    others = [o for k, o in enumerate(objs) if k != main]
    order = [objs[main]] + pick.sample(others, len(others))
    sized = pick.chance(0.5)
    items = _join([_phrase(o, pick, size_word=sized) for o in order])
    return pick.choice(_LIST_TEMPLATES).format(items, bg=bg)


def _count_caption(objs: list[Obj], main: int, pick: Picker, bg: str) -> str:
    """'three shapes: two red stars and a blue circle.' (groups of equal shape and colour)."""
    groups: dict[tuple[int, int], int] = {}
    for o in [objs[main]] + [o for k, o in enumerate(objs) if k != main]:
        groups[(o.colour, o.shape)] = groups.get((o.colour, o.shape), 0) + 1
    parts = []
    for (colour, shape), count in groups.items():
        if count == 1:
            det = "one" if pick.chance(0.3) else _article(COLOURS[colour])
            parts.append(f"{det} {COLOURS[colour]} {SHAPES[shape]}")
        else:
            parts.append(f"{COUNT_NAMES[count - 1]} {COLOURS[colour]} {_plural(SHAPES[shape])}")
    n = len(objs)
    noun = pick.choice(("shape", "object")) if n == 1 else pick.choice(("shapes", "objects"))
    template = pick.choice(_COUNT_TEMPLATES)
    return template.format(_join(parts), n=COUNT_NAMES[n - 1], noun=noun, bg=bg)


def _relation_caption(objs: list[Obj], main: int, pick: Picker, bg: str, side: int) -> str:
    """'a red star left of a blue circle, with a green square.'; alone: 'a red star on the left.'"""
    a = objs[main]
    if len(objs) == 1:
        core = f"{_phrase(a, pick, size_word=pick.chance(0.5))} {_position(a, side)}"
        return pick.choice(_RELATION_TEMPLATES).format(core, bg=bg)
    others = [o for k, o in enumerate(objs) if k != main]
    others = pick.sample(others, len(others))
    b, rest = others[0], others[1:]
    rel = _relation(a, b)
    if pick.chance(0.5):  # say it from the other object's side
        a, b, rel = b, a, _INVERSE[rel]
    rel_words = pick.choice(_RELATION_WORDS[rel])
    if pick.chance(0.3):
        core = f"{_phrase(a, pick, article='the')} is {rel_words} {_phrase(b, pick, article='the')}"
    else:
        core = f"{_phrase(a, pick)} {rel_words} {_phrase(b, pick)}"
    if rest:
        core += f", {pick.choice(('with', 'plus'))} {_join([_phrase(o, pick) for o in rest])}"
    return pick.choice(_RELATION_TEMPLATES).format(core, bg=bg)


def _loose_caption(objs: list[Obj], main: int, pick: Picker) -> str:
    """A true but partial caption, never equal to a faithful one (those name every object with
    its colour): only the main shape's realm, only some objects, or only a colour."""
    mode = pick.uniform()
    if mode < 0.4:  # realm of the main object only
        realm = SHAPE_REALM[objs[main].shape]
        n_realm = sum(SHAPE_REALM[o.shape] == realm for o in objs)
        name = REALMS[realm]
        phrase = f"some {_plural(name)}" if n_realm > 1 else f"{_article(name)} {name}"
        return pick.choice(_LOOSE_REALM_TEMPLATES).format(phrase)
    if mode < 0.85:  # some of the objects; all of them only when their colours are left out
        k = 1 + pick.index(len(objs))
        chosen = pick.sample(objs, k)
        with_colour = k < len(objs) and pick.chance(0.5)
        items = _join([_phrase(o, pick, colour=with_colour) for o in chosen])
        if k < len(objs) and pick.chance(0.4):
            return f"{items} {pick.choice(('and more', 'among other shapes', 'and other things'))}."
        return pick.choice(_LOOSE_OBJECT_TEMPLATES).format(items)
    colour = COLOURS[pick.choice(objs).colour]
    return pick.choice(_LOOSE_COLOUR_TEMPLATES).format(colour)


def _reference_captions(objs: list[Obj], main: int, pick: Picker, bg: str,
                        side: int) -> tuple[str, ...]:
    """2–3 faithful captions, each from a different caption kind, so they are distinct."""
    kinds = pick.sample((0, 1, 2), 2 + pick.index(2))
    out = []
    for kind in kinds:
        if kind == 0:
            out.append(_list_caption(objs, main, pick, bg))
        elif kind == 1:
            out.append(_count_caption(objs, main, pick, bg))
        else:
            out.append(_relation_caption(objs, main, pick, bg, side))
    return tuple(dict.fromkeys(out))  # drop an (unexpected) duplicate, keep order


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

        captions = _reference_captions(objs, main, pick, BACKGROUNDS[bg_kind], side)
        if pick.chance(self.loose_caption_prob):
            caption = _loose_caption(objs, main, pick)
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
    return _Description(_random_group(pick), pick.choice(tuple(_INVERSE)), _random_group(pick))


def _mutate(desc: _Description, pick: Picker, p: float) -> _Description:
    """Re-draw each attribute of ``desc`` with probability p (p = 0 keeps it)."""
    def group(g: _Group) -> _Group:
        shape = pick.index(len(SHAPES)) if pick.chance(p) else g.shape
        colour = pick.index(len(COLOURS)) if pick.chance(p) else g.colour
        count = 1 + pick.index(3) if pick.chance(p) else g.count
        return _Group(shape, colour, count)

    if pick.chance(p / 2):  # change the structure: add or drop the second group
        if desc.second is None:
            return _Description(group(desc.first), pick.choice(tuple(_INVERSE)),
                                _random_group(pick))
        return _Description(group(desc.first), None, None)
    if desc.second is None:
        return _Description(group(desc.first), None, None)
    relation = pick.choice(tuple(_INVERSE)) if pick.chance(p) else desc.relation
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
    return _Description(d.second, _INVERSE[d.relation], d.first)


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
        return f"{_article(COLOURS[g.colour])} {COLOURS[g.colour]} {SHAPES[g.shape]}"
    return f"{COUNT_NAMES[g.count - 1]} {COLOURS[g.colour]} {_plural(SHAPES[g.shape])}"


_STS_TEMPLATES = ("{}.", "a picture of {}.", "an image with {}.", "we see {}.")


def _describe(d: _Description, pick: Picker) -> str:
    """Caption of a description, in a random paraphrase (relation possibly said backwards)."""
    if d.second is None:
        core = _group_text(d.first)
    else:
        if pick.chance(0.3):
            d = _flip(d)
        core = f"{_group_text(d.first)} {pick.choice(_RELATION_WORDS[d.relation])} " \
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
