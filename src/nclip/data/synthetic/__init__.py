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

Modules: ``shapes`` (vocabulary and shape geometry), ``picker`` (buffered random draws),
``render`` (layout, masks, background, image), ``captions`` (the caption grammar), ``scenes`` (the
dataset, its label spaces and prompt templates) and ``sts`` (the text pairs).
"""

from nclip.data.synthetic.scenes import (
    COLOUR_TEMPLATES,
    COUNT_TEMPLATES,
    REALM_TEMPLATES,
    SHAPE_TEMPLATES,
    SIZE_TEMPLATES,
    SPLITS,
    SyntheticScenes,
)
from nclip.data.synthetic.shapes import BACKGROUNDS, COLOURS, COUNT_NAMES, REALMS, SHAPE_REALM, SHAPES, SIZES
from nclip.data.synthetic.sts import sts_pairs

__all__ = [
    "SyntheticScenes", "sts_pairs",
    "SHAPES", "REALMS", "SHAPE_REALM", "COLOURS", "COUNT_NAMES", "SIZES", "SPLITS", "BACKGROUNDS",
    "SHAPE_TEMPLATES", "COLOUR_TEMPLATES", "COUNT_TEMPLATES", "REALM_TEMPLATES", "SIZE_TEMPLATES",
]
