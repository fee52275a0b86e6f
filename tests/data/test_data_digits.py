"""scikit-learn digits as image-text pairs: splits, labels, captions."""

import re

import numpy as np
import pytest

from nclip.data.digits import DIGIT_NAMES, DigitsPairs


@pytest.fixture(scope="module")
def splits() -> dict[str, DigitsPairs]:
    return {s: DigitsPairs(s, seed=0) for s in ("train", "val", "test")}


def test_split_sizes_are_stratified_and_disjoint(splits):
    sizes = {s: len(d) for s, d in splits.items()}
    assert sum(sizes.values()) == 1797
    assert abs(sizes["test"] - 0.25 * 1797) <= 1
    assert abs(sizes["val"] - 0.1 * (1797 - sizes["test"])) <= 1
    index_sets = [set(d.indices.tolist()) for d in splits.values()]
    assert set.union(*index_sets) == set(range(1797))
    assert sum(len(x) for x in index_sets) == 1797  # pairwise disjoint
    for d in splits.values():  # every digit in every split, in about the overall proportion
        counts = np.bincount(d.targets, minlength=10)
        assert (np.abs(counts / len(d) - 0.1) < 0.03).all()


def test_samples(splits):
    d = splits["test"]
    for i in (0, 17, len(d) - 1):
        s = d[i]
        digit = s.labels["digit"]
        assert digit == d.targets[i]
        assert s.image.shape == (32, 32, 3) and s.image.dtype == np.uint8
        assert (s.image[..., 0] == s.image[..., 2]).all()  # grey as RGB
        assert s.multilabels["digit"].dtype == bool
        assert s.multilabels["digit"].sum() == 1 and s.multilabels["digit"][digit]
        assert s.masks.shape == (1, 32, 32) and s.masks.any()
        assert len(s.captions) == 2 and len({s.caption, *s.captions}) == 3
        for text in (s.caption, *s.captions):
            words = re.findall(r"\w+", text)
            assert DIGIT_NAMES[digit] in words or str(digit) in words, text
            assert not any(n in words for n in DIGIT_NAMES if n != DIGIT_NAMES[digit])
    assert d[-1].caption == d[len(d) - 1].caption
    with pytest.raises(IndexError):
        d[len(d)]


def test_deterministic_and_seeded(splits):
    again = DigitsPairs("test", seed=0)
    assert np.array_equal(again.indices, splits["test"].indices)
    assert again[3].image.tobytes() == splits["test"][3].image.tobytes()
    assert (again[3].caption, again[3].captions) == (splits["test"][3].caption,
                                                     splits["test"][3].captions)
    assert not np.array_equal(DigitsPairs("test", seed=1).indices, again.indices)


def test_options():
    small = DigitsPairs("train", image_size=16, val_fraction=0.0)
    assert small[0].image.shape == (16, 16, 3) and small[0].masks.shape == (1, 16, 16)
    assert len(DigitsPairs("val", val_fraction=0.0)) == 0
    assert DigitsPairs("train").label_kinds["digit"].names == DIGIT_NAMES


@pytest.mark.parametrize("kwargs", [
    {"split": "dev"}, {"seed": -2}, {"image_size": 4}, {"test_fraction": 0.0},
    {"test_fraction": 1.0}, {"val_fraction": 1.0},
])  # fmt: skip
def test_bad_arguments_raise(kwargs):
    with pytest.raises(ValueError, match=re.escape(repr(next(iter(kwargs.values()))))):
        DigitsPairs(**kwargs)
