"""Text similarity pairs (STS) from the caption grammar, with a graded similarity score."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from nclip.data.synthetic.captions import INVERSE, RELATION_WORDS, indefinite_article, plural
from nclip.data.synthetic.picker import Picker
from nclip.data.synthetic.scenes import check_int
from nclip.data.synthetic.shapes import COLOURS, COUNT_NAMES, SHAPE_REALM, SHAPES

_STS_SALT = 0x575


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
    n = check_int("n", n, 0)
    seed = check_int("seed", seed, 0)
    pick = Picker(np.random.default_rng([seed, _STS_SALT]))
    pairs = []
    for _ in range(n):
        a = _random_description(pick)
        b = a if pick.chance(0.1) else _mutate(a, pick, pick.uniform())
        pairs.append((_describe(a, pick), _describe(b, pick), round(_sts_similarity(a, b), 4)))
    return pairs
