"""The caption grammar: faithful reference captions of a scene and loose (partial) ones.

A faithful caption names every object with its colour: a list, a counted grouping or a spatial
relation; a loose one names only the main shape's realm, some objects or a colour.
"""

from __future__ import annotations

from nclip.data.synthetic.picker import Picker
from nclip.data.synthetic.render import Obj
from nclip.data.synthetic.shapes import COLOURS, COUNT_NAMES, REALMS, SHAPE_REALM, SHAPES

_PLURAL = {"cross": "crosses"}  # every other noun takes a plain "s"


def plural(noun: str) -> str:
    """English plural of a shape, realm or "shape" noun ("cross" -> "crosses")."""
    return _PLURAL.get(noun, noun + "s")


def indefinite_article(word: str) -> str:
    """'an' before a vowel, else 'a' (right for every word of the vocabulary)."""
    return "an" if word[0] in "aeiou" else "a"


_SIZE_WORDS = (("small", "small", "little"), ("large", "large", "big"))
# Relation of object a to object b, with paraphrases; the first is the canonical word.
RELATION_WORDS = {
    "left of": ("left of", "to the left of"),
    "right of": ("right of", "to the right of"),
    "above": ("above", "above"),
    "below": ("below", "under"),
}
# The relation of b to a, given that of a to b.
INVERSE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
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
    return f"{article or indefinite_article(words[0])} {' '.join(words)}"


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
            det = "one" if pick.chance(0.3) else indefinite_article(COLOURS[colour])
            parts.append(f"{det} {COLOURS[colour]} {SHAPES[shape]}")
        else:
            parts.append(f"{COUNT_NAMES[count - 1]} {COLOURS[colour]} {plural(SHAPES[shape])}")
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
        a, b, rel = b, a, INVERSE[rel]
    rel_words = pick.choice(RELATION_WORDS[rel])
    if pick.chance(0.3):
        core = f"{_phrase(a, pick, article='the')} is {rel_words} {_phrase(b, pick, article='the')}"
    else:
        core = f"{_phrase(a, pick)} {rel_words} {_phrase(b, pick)}"
    if rest:
        core += f", {pick.choice(('with', 'plus'))} {_join([_phrase(o, pick) for o in rest])}"
    return pick.choice(_RELATION_TEMPLATES).format(core, bg=bg)


def loose_caption(objs: list[Obj], main: int, pick: Picker) -> str:
    """A true but partial caption, never equal to a faithful one (those name every object with
    its colour): only the main shape's realm, only some objects, or only a colour."""
    mode = pick.uniform()
    if mode < 0.4:  # realm of the main object only
        realm = SHAPE_REALM[objs[main].shape]
        n_realm = sum(SHAPE_REALM[o.shape] == realm for o in objs)
        name = REALMS[realm]
        phrase = f"some {plural(name)}" if n_realm > 1 else f"{indefinite_article(name)} {name}"
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


def reference_captions(objs: list[Obj], main: int, pick: Picker, bg: str,
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
