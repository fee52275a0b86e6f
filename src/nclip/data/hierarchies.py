"""Built-in class hierarchies of the built-in data (for ReCo's Eq. 4 similarity and realm-wise
evaluation, :mod:`nclip.data.hierarchy`).

* synthetic ``shape`` (and ``realm``): root "shape" -> the three realms the scenes already use
  (``REALMS``: polygon, curved shape, symbol) -> the 15 shapes, from ``SHAPE_REALM``. The realm
  nodes are the realm label's classes, so the same tree covers the ``realm`` labels.
* synthetic ``colour``: root "colour" -> warm / cool / neutral -> the 10 colours. *Made up* for
  testing hierarchy-aware objectives; no paper defines it.
* digits ``digit``: root "digit" -> round (zero, six, eight, nine) / straight (one, four, seven) /
  mixed (two, three, five) -> digit names. *Made up* from the strokes of printed numerals.

Class names are exactly the ``label_kinds`` names of the data (``SHAPES``, ``COLOURS``,
``DIGIT_NAMES``), so ``hierarchy.check_covers(label_space.classnames)`` holds.
"""

from __future__ import annotations

from nclip.data.digits import DIGIT_NAMES
from nclip.data.hierarchy import Hierarchy
from nclip.data.synthetic.shapes import COLOURS, REALMS, SHAPE_REALM, SHAPES
from nclip.errors import NclipError

COLOUR_GROUPS = {"warm": ("red", "orange", "yellow", "pink"), "cool": ("green", "cyan", "blue", "purple"),
                 "neutral": ("white", "black")}
DIGIT_GROUPS = {"round": ("zero", "six", "eight", "nine"), "straight": ("one", "four", "seven"),
                "mixed": ("two", "three", "five")}
assert sorted(sum(COLOUR_GROUPS.values(), ())) == sorted(COLOURS)
assert sorted(sum(DIGIT_GROUPS.values(), ())) == sorted(DIGIT_NAMES)


def _grouped(root: str, groups: dict[str, tuple[str, ...]]) -> Hierarchy:
    parents: dict[str, str | None] = {root: None}
    for group, members in groups.items():
        parents[group] = root
        parents.update({m: group for m in members})
    return Hierarchy(parents, require_single_root=True)


def _shapes() -> Hierarchy:
    groups = {realm: tuple(s for s, r in zip(SHAPES, SHAPE_REALM) if r == k) for k, realm in enumerate(REALMS)}
    return _grouped("shape", groups)


_BUILTIN = {
    ("synthetic", "shape"): _shapes,
    ("synthetic", "realm"): _shapes,
    ("synthetic", "colour"): lambda: _grouped("colour", COLOUR_GROUPS),
    ("digits", "digit"): lambda: _grouped("digit", DIGIT_GROUPS),
}


def builtin_hierarchy(source: str, label_key: str | None = None) -> Hierarchy:
    """The hierarchy of a built-in source's label kind (``None``: the source's main kind, as training uses)."""
    from nclip.data.sources import MAIN_LABEL

    if source not in MAIN_LABEL:
        raise NclipError(f"no built-in hierarchy for data source {source!r} (built-in: {', '.join(MAIN_LABEL)}); "
                         "give a hierarchy file")
    key = label_key or MAIN_LABEL[source]
    if (source, key) not in _BUILTIN:
        have = ", ".join(k for s, k in _BUILTIN if s == source)
        raise NclipError(f"no built-in hierarchy for {source} label {key!r} (built-in: {have}); give a hierarchy file")
    return _BUILTIN[source, key]()
