"""The ``SyntheticScenes`` dataset (see the package docstring), its label spaces and prompt templates."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np

from nclip.data.synthetic.captions import loose_caption, reference_captions
from nclip.data.synthetic.picker import Picker
from nclip.data.synthetic.render import Grid, layout, render
from nclip.data.synthetic.shapes import BACKGROUNDS, COLOURS, COUNT_NAMES, REALMS, SHAPE_REALM, SHAPES, SIZES
from nclip.data.types import LabelKind, Sample

SPLITS: tuple[str, ...] = ("train", "val", "test")
_SALT = 0x5C3E  # separates this generator's streams from other users of the same seed
_GROUP_TAG = 0x6E  # the streams of hard-negative groups, apart from those of single samples

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


def _label_kinds(max_objects: int) -> dict[str, LabelKind]:
    return {
        "shape": LabelKind(SHAPES, SHAPE_TEMPLATES),
        "colour": LabelKind(COLOURS, COLOUR_TEMPLATES),
        "count": LabelKind(COUNT_NAMES[:max_objects], COUNT_TEMPLATES),
        "realm": LabelKind(REALMS, REALM_TEMPLATES),
        "size": LabelKind(SIZES, SIZE_TEMPLATES),
    }


def check_int(name: str, value, low: int, high: int | None = None) -> int:
    """``value`` as an int if it is an integer (not a bool) in [low, high], else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    return int(value)


class SyntheticScenes(Sequence):
    """Procedural scenes of coloured shapes with captions; see the docstring of ``nclip.data.synthetic``.

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
        self.length = check_int("length", length, 0)
        self.seed = check_int("seed", seed, 0)
        self.image_size = check_int("image_size", image_size, 16)
        self.max_objects = check_int("max_objects", max_objects, 1, len(COUNT_NAMES))
        if not isinstance(loose_caption_prob, (int, float)) or not 0 <= loose_caption_prob <= 1:
            raise ValueError(f"loose_caption_prob must be in [0, 1], got {loose_caption_prob!r}")
        self.loose_caption_prob = float(loose_caption_prob)
        self.hard_negative_group = check_int("hard_negative_group", hard_negative_group, 1)
        self.label_kinds = _label_kinds(self.max_objects)
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
            mask_classes=np.array([o.shape for o in objs], dtype=np.int64),
        )
