"""The built-in hierarchies cover every label of the built-in data, with the realms the scenes use."""

import pytest

from nclip.data.digits import DigitsPairs
from nclip.data.hierarchies import builtin_hierarchy
from nclip.data.synthetic import SyntheticScenes
from nclip.data.synthetic.shapes import REALMS, SHAPE_REALM, SHAPES
from nclip.errors import NclipError


@pytest.mark.parametrize("source, data, keys", [
    ("synthetic", lambda: SyntheticScenes("test", length=1), ("shape", "realm", "colour")),
    ("digits", lambda: DigitsPairs("test"), ("digit",)),
])
def test_builtin_hierarchies_cover_the_labels(source, data, keys):
    spaces = data().label_kinds
    for key in keys:
        h = builtin_hierarchy(source, key)
        h.check_covers(spaces[key].names)
        assert h.root not in spaces[key].names
    main = builtin_hierarchy(source)  # the source's main label kind
    assert set(main.classes) == set(spaces["shape" if source == "synthetic" else "digit"].names)


def test_synthetic_realms_are_the_scenes_realms():
    h = builtin_hierarchy("synthetic", "shape")
    assert h.realms(SHAPES) == {s: REALMS[r] for s, r in zip(SHAPES, SHAPE_REALM)}
    assert [h.depth(s) for s in SHAPES] == [2] * len(SHAPES)


def test_made_up_hierarchies_have_one_depth():
    for source, key in (("synthetic", "colour"), ("digits", "digit")):
        h = builtin_hierarchy(source, key)
        assert {h.depth(c) for c in h.classes} == {2}
        sim = h.normalized_similarity(list(h.classes))
        assert bool((sim.diagonal() == 1).all())


@pytest.mark.parametrize("source, key, needle", [
    ("synthetic", "count", "no built-in hierarchy for synthetic label 'count'"),
    ("csv", None, "no built-in hierarchy for data source 'csv'"),
])
def test_unknown_builtin(source, key, needle):
    with pytest.raises(NclipError, match=needle):
        builtin_hierarchy(source, key)
