"""scikit-learn's 8x8 handwritten digits as image–text pairs (shipped with scikit-learn).

Each of the 1,797 digits becomes an RGB image (grey upscaled bilinearly to ``image_size``, bright
strokes on a dark background, as in the source data) with a caption made from a prompt template
and the digit's name or numeral ("a photo of the digit seven", "an image of a handwritten 7").
All captions are faithful: there are no loose captions here.

Splits (deterministic in ``seed``, stratified by digit, disjoint):

* "test": ``test_fraction`` of all digits;
* "val":  ``val_fraction`` of the remaining digits, held out of "train";
* "train": the rest.

``masks`` holds one object per sample: the digit's strokes, i.e. upscaled pixels brighter than
``STROKE_THRESHOLD`` (the 8x8 source values run from 0 to 16, scaled to 0..255 first).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence

import numpy as np
from PIL import Image

from nclip.data.types import LabelKind, Sample

DIGIT_NAMES: tuple[str, ...] = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
)  # fmt: skip
SPLITS: tuple[str, ...] = ("train", "val", "test")
STROKE_THRESHOLD = 96  # on the 0..255 upscaled grey image

# Caption templates: "{name}" is the word ("seven"), "{numeral}" the figure ("7").
CAPTION_TEMPLATES: tuple[str, ...] = (
    "a photo of the digit {name}.",
    "an image of a handwritten {numeral}.",
    "a handwritten {name}.",
    "the number {name}, written by hand.",
    "a picture of the digit {numeral}.",
    "a scan of a handwritten digit {name}.",
    "a blurry {name}.",
)
# Zero-shot prompts: filled with the class names, which the captions use word for word.
DIGIT_TEMPLATES: tuple[str, ...] = (
    "a photo of the digit {}.",
    "a handwritten {}.",
    "the number {}, written by hand.",
    "a scan of a handwritten digit {}.",
)
_SALT = 0xD161  # separates the caption draws from other users of the same seed


@functools.lru_cache(maxsize=1)
def _load() -> tuple[np.ndarray, np.ndarray]:
    """(images float [1797, 8, 8] in 0..16, targets int [1797]); read once per process."""
    from sklearn.datasets import load_digits

    data = load_digits()
    return data.images, data.target.astype(np.int64)


def split_indices(targets: np.ndarray, seed: int, test_fraction: float,
                  val_fraction: float) -> dict[str, np.ndarray]:
    """Stratified, disjoint, sorted index arrays {"train", "val", "test"} into ``targets`` [N]."""
    from sklearn.model_selection import train_test_split

    everything = np.arange(len(targets))
    rest, test = train_test_split(everything, test_size=test_fraction, random_state=seed,
                                  stratify=targets)
    if val_fraction > 0:
        train, val = train_test_split(rest, test_size=val_fraction, random_state=seed,
                                      stratify=targets[rest])
    else:
        train, val = rest, rest[:0]
    return {"train": np.sort(train), "val": np.sort(val), "test": np.sort(test)}


def _upscale(images: np.ndarray, size: int) -> np.ndarray:
    """uint8 [N, size, size] bilinear upscaling of float [N, 8, 8] images with values in 0..16."""
    grey = np.clip(np.rint(images * (255.0 / 16.0)), 0, 255).astype(np.uint8)
    return np.stack([np.asarray(Image.fromarray(g).resize((size, size), Image.BILINEAR))
                     for g in grey]) if len(grey) else np.zeros((0, size, size), np.uint8)


class DigitsPairs(Sequence):
    """scikit-learn digits as a ``Sequence[Sample]``; see the module docstring.

    Args:
        split: "train", "val" or "test".
        seed: non-negative integer fixing the split and the caption templates.
        image_size: side S of the square RGB images, >= 8.
        test_fraction: share of all digits in "test", in (0, 1).
        val_fraction: share of the non-test digits held out as "val", in [0, 1) (0: empty "val").

    Items: image uint8 [S, S, 3]; caption and 2 reference captions naming the digit; labels
    {"digit": d}; multilabels {"digit": one-hot bool [10]}; masks bool [1, S, S] (strokes).
    ``indices`` int [len] are the positions in ``sklearn.datasets.load_digits()``.
    """

    def __init__(self, split: str = "train", seed: int = 0, image_size: int = 32,
                 test_fraction: float = 0.25, val_fraction: float = 0.1):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        if isinstance(image_size, bool) or not isinstance(image_size, (int, np.integer)) \
                or image_size < 8:
            raise ValueError(f"image_size must be an integer >= 8, got {image_size!r}")
        if not isinstance(test_fraction, (int, float)) or not 0 < test_fraction < 1:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
        if not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
        self.split, self.seed, self.image_size = split, int(seed), int(image_size)
        self.test_fraction, self.val_fraction = float(test_fraction), float(val_fraction)
        self.label_kinds = {"digit": LabelKind(DIGIT_NAMES, DIGIT_TEMPLATES)}

        images, targets = _load()
        self.indices = split_indices(targets, self.seed, self.test_fraction,
                                     self.val_fraction)[split]
        self.targets = targets[self.indices]  # [len]
        self._grey = _upscale(images[self.indices], self.image_size)  # uint8 [len, S, S]

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        i = operator.index(index)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} samples")
        return self._sample(i)

    def __repr__(self) -> str:
        return (f"DigitsPairs(split={self.split!r}, seed={self.seed}, "
                f"image_size={self.image_size}, test_fraction={self.test_fraction}, "
                f"val_fraction={self.val_fraction})")

    def _captions(self, source_index: int, digit: int) -> list[str]:
        """3 distinct captions; the templates depend on (seed, position in the source data) only,
        so an image keeps its captions whatever the split settings."""
        rng = np.random.default_rng([self.seed, _SALT, source_index])
        chosen = rng.permutation(len(CAPTION_TEMPLATES))[:3]
        return [CAPTION_TEMPLATES[t].format(name=DIGIT_NAMES[digit], numeral=digit)
                for t in chosen]

    def _sample(self, i: int) -> Sample:
        digit = int(self.targets[i])
        grey = self._grey[i]  # [S, S]
        caption, *references = self._captions(int(self.indices[i]), digit)
        onehot = np.zeros(len(DIGIT_NAMES), dtype=bool)
        onehot[digit] = True
        return Sample(
            image=np.repeat(grey[:, :, None], 3, axis=2),  # a fresh array: the cache stays intact
            caption=caption,
            captions=tuple(references),
            labels={"digit": digit},
            multilabels={"digit": onehot},
            masks=(grey > STROKE_THRESHOLD)[None],
        )
