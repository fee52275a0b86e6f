"""Synthetic scenes: determinism, label/mask consistency, caption grammar, STS pairs."""

import re

import numpy as np
import pytest

from nclip.data.synthetic import COLOURS, REALMS, SHAPE_REALM, SHAPES, SyntheticScenes, sts, sts_pairs
from nclip.data.synthetic.picker import Picker
from nclip.data.synthetic.shapes import RGB
from nclip.data.types import LabelKind, Sample


def mentions(text: str, noun: str) -> bool:
    """Whole-word match of a noun or its plural ("cross" / "crosses", "curved shapes")."""
    return re.search(rf"\b{re.escape(noun)}(e?s)?\b", text) is not None


@pytest.fixture(scope="module")
def samples() -> list[Sample]:
    return SyntheticScenes("train", length=500, seed=3)[:]


def test_vocabulary_sizes():
    assert len(SHAPES) >= 12 and len(set(SHAPES)) == len(SHAPES)
    assert len(REALMS) >= 3 and len(COLOURS) >= 8
    assert len(SHAPE_REALM) == len(SHAPES)
    assert set(SHAPE_REALM) == set(range(len(REALMS)))


def test_label_spaces():
    ds = SyntheticScenes(length=1, max_objects=3)
    spaces = ds.label_kinds
    assert set(spaces) == {"shape", "colour", "count", "realm", "size"}
    assert all(isinstance(s, LabelKind) for s in spaces.values())
    assert spaces["shape"].names == SHAPES and len(spaces["shape"].templates) >= 4
    assert spaces["count"].names == ("one", "two", "three")
    for space in spaces.values():
        assert all(t.count("{}") == 1 for t in space.templates)
        assert len(space.prompts(0)) == len(space.templates)


def test_sequence_protocol_and_shapes():
    ds = SyntheticScenes("val", length=5, image_size=48)
    assert len(ds) == 5
    s = ds[0]
    assert s.image.shape == (48, 48, 3) and s.image.dtype == np.uint8
    assert s.masks.dtype == bool and s.masks.shape[1:] == (48, 48)
    assert ds[-1].caption == ds[4].caption
    assert ds[np.int64(2)].caption == ds[2].caption
    assert [x.caption for x in ds[1:3]] == [ds[1].caption, ds[2].caption]
    assert len(list(ds)) == 5
    for bad in (5, -6):
        with pytest.raises(IndexError):
            ds[bad]


def test_deterministic_and_split_streams_differ():
    a = SyntheticScenes("train", length=20, seed=7)
    b = SyntheticScenes("train", length=20, seed=7)
    for i in (0, 5, 19):
        x, y = a[i], b[i]
        assert x.image.tobytes() == y.image.tobytes()
        assert (x.caption, x.captions, x.labels) == (y.caption, y.captions, y.labels)
        assert np.array_equal(x.masks, y.masks)
    for other in (SyntheticScenes("val", length=20, seed=7), SyntheticScenes("test", length=20,
                                                                              seed=7),
                  SyntheticScenes("train", length=20, seed=8)):
        assert all(a[i].image.tobytes() != other[i].image.tobytes() for i in range(5))


def test_image_does_not_depend_on_caption_settings():
    a = SyntheticScenes(length=10, loose_caption_prob=0.0)
    b = SyntheticScenes(length=10, loose_caption_prob=1.0)
    assert all(a[i].image.tobytes() == b[i].image.tobytes() for i in range(10))


def test_labels_and_masks_are_consistent(samples):
    for s in samples:
        n = s.masks.shape[0]
        lab = s.labels
        assert lab["count"] == n - 1 and 1 <= n <= 4
        assert lab["realm"] == SHAPE_REALM[lab["shape"]] and lab["size"] in (0, 1)
        areas = s.masks.sum(axis=(1, 2))
        assert (areas > 0).all()  # every counted object is visible
        assert (s.masks.sum(axis=0) <= 1).all()  # visible masks do not overlap
        present = s.multilabels["shape"]
        assert present.dtype == bool and present.shape == (len(SHAPES),)
        assert present[lab["shape"]] and 1 <= present.sum() <= n
        assert s.multilabels["colour"][lab["colour"]]
        # The main object has the largest mask, and the pixels there have its colour.
        main_pixels = s.image[s.masks[int(areas.argmax())]].astype(int)  # [P, 3]
        assert np.abs(main_pixels - RGB[lab["colour"]]).max() <= 12
        assert (main_pixels == main_pixels[0]).all()  # flat colour


def test_objects_stand_out_from_background(samples):
    for s in samples[:100]:
        background = s.image[~s.masks.any(axis=0)].astype(float).mean(axis=0)  # [3]
        for mask in s.masks:
            colour = s.image[mask][0].astype(float)
            assert np.abs(colour - background).max() > 25


def test_reference_captions_are_faithful_paraphrases(samples):
    for s in samples:
        assert 2 <= len(s.captions) <= 3 and len(set(s.captions)) == len(s.captions)
        main_shape = SHAPES[s.labels["shape"]]
        for text in s.captions:
            assert mentions(text, main_shape), (text, main_shape)
            assert COLOURS[s.labels["colour"]] in text
            # No shape is mentioned that is not in the picture.
            for k, shape in enumerate(SHAPES):
                if mentions(text, shape):
                    assert s.multilabels["shape"][k], (text, shape)


def test_loose_captions(samples):
    loose = [s for s in samples if s.caption not in s.captions]
    assert abs(len(loose) / len(samples) - 0.3) < 0.07
    for s in loose:
        present = [SHAPES[k] for k in np.flatnonzero(s.multilabels["shape"])]
        realm = REALMS[s.labels["realm"]]
        colours = [COLOURS[k] for k in np.flatnonzero(s.multilabels["colour"])]
        assert any(mentions(s.caption, w) for w in present + [realm] + colours), s.caption
        for k, shape in enumerate(SHAPES):
            if mentions(s.caption, shape):
                assert s.multilabels["shape"][k]
    strict = SyntheticScenes(length=100, loose_caption_prob=0.0)
    assert all(s.caption in s.captions for s in strict)


def test_captions_use_every_class_name(samples):
    text = " ".join(c for s in samples for c in (s.caption, *s.captions))
    for name in SHAPES + COLOURS + REALMS + ("one", "two", "three", "four", "small", "large"):
        assert mentions(text, name), name
    for relation in ("left of", "right of", "above", "below"):
        assert relation in text


def test_hard_negative_groups_share_the_scene_but_not_the_shapes():
    g = 4
    ds = SyntheticScenes("train", length=12 * g, seed=5, hard_negative_group=g)
    differing_groups = 0
    for start in range(0, len(ds), g):
        group = ds[start : start + g]
        # colours, count and sizes of the main object's scene are the group's
        assert len({s.labels["count"] for s in group}) == 1
        assert len({s.multilabels["colour"].tobytes() for s in group}) == 1
        # pixels that no member's object covers are the same background in every member
        covered = np.logical_or.reduce([s.masks.any(axis=0) for s in group])
        backgrounds = [s.image[~covered] for s in group]
        assert all(np.array_equal(b, backgrounds[0]) for b in backgrounds)
        differing_groups += len({s.multilabels["shape"].tobytes() for s in group}) > 1
    assert differing_groups >= 11  # 15 shapes: a whole group with equal shapes is rare
    # deterministic, and a group differs from the next one
    again = SyntheticScenes("train", length=12 * g, seed=5, hard_negative_group=g)
    assert all(ds[i].image.tobytes() == again[i].image.tobytes() for i in range(2 * g))
    assert ds[0].image.tobytes() != ds[g].image.tobytes()
    # a group of one is the plain generator
    plain, single = SyntheticScenes(length=5), SyntheticScenes(length=5, hard_negative_group=1)
    assert all(plain[i].image.tobytes() == single[i].image.tobytes() for i in range(5))


@pytest.mark.parametrize("kwargs", [
    {"split": "training"}, {"length": -1}, {"length": 2.5}, {"seed": -1},
    {"image_size": 8}, {"max_objects": 0}, {"max_objects": 7},
    {"loose_caption_prob": 1.5}, {"loose_caption_prob": -0.1}, {"hard_negative_group": 0},
])  # fmt: skip
def test_bad_arguments_raise(kwargs):
    name, value = next(iter(kwargs.items()))
    with pytest.raises(ValueError, match=re.escape(repr(value))):
        SyntheticScenes(**kwargs)


def test_sts_pairs():
    pairs = sts_pairs(400, seed=1)
    assert len(pairs) == 400 and pairs == sts_pairs(400, seed=1)
    assert pairs[:10] == sts_pairs(10, seed=1) and pairs != sts_pairs(400, seed=2)
    scores = np.array([p[2] for p in pairs])
    assert ((scores >= 0) & (scores <= 5)).all()
    assert scores.min() < 1.5 and scores.std() > 1.0  # graded, not constant
    identical = [p for p in pairs if p[0] == p[1]]
    assert identical and all(p[2] == 5.0 for p in identical)
    assert all(isinstance(a, str) and isinstance(b, str) for a, b, _ in pairs)


def test_sts_similarity_is_symmetric_and_reads_relations_both_ways():
    pick = Picker(np.random.default_rng(0))
    for _ in range(50):
        a, b = sts._random_description(pick), sts._random_description(pick)
        assert sts._sts_similarity(a, a) == 5.0
        assert sts._sts_similarity(a, sts._flip(a)) == 5.0  # "X left of Y" == "Y right of X"
        assert sts._sts_similarity(a, b) == pytest.approx(sts._sts_similarity(b, a))
    with pytest.raises(ValueError):
        sts_pairs(-1)
