"""The sample and label-space types that every nclip dataset produces.

Every dataset (synthetic scenes, digits, user data) is a ``Sequence[Sample]`` with a
``label_kinds`` attribute, so that training, zero-shot evaluation and the probes can treat them
alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class LabelKind:
    """The classes of one label kind, with the prompt templates used for zero-shot transfer.

    ``templates`` hold one ``{}`` each, filled with a class name (e.g. ``"a photo of a {}."``).
    """

    names: tuple[str, ...]
    templates: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.names)

    def prompts(self, index: int) -> list[str]:
        return [t.format(self.names[index]) for t in self.templates]


@dataclass
class Sample:
    """One image-text pair with the labels kept for evaluation.

    image:       uint8 array [H, W, 3], RGB; in evaluation's samples of image files, an image whose
                 mode is not RGB is the decoded PIL image, converted where the model's convention
                 converts it (nclip.data.transforms.eval_resize; rgb_array for the RGB pixels).
    caption:     the training caption (may be *loose*: mention only part of the image).
    captions:    reference captions for retrieval evaluation (>= 1, all faithful to the image).
    labels:      single-label targets by kind, e.g. {"shape": 3, "colour": 1, "count": 2, "realm": 0},
                 each an index into the dataset's ``label_kinds[kind]``.
    multilabels: multi-hot targets by kind, e.g. {"shape": bool[n_shapes]} (set of shapes present).
    masks:       bool [n_objects, H, W] object masks, or None when the dataset has none.
    mask_classes: int [n_objects]: each mask's class (synthetic scenes: its shape, an index into
                 ``label_kinds["shape"]``), for zero-shot segmentation; None when unknown.
    """

    image: np.ndarray
    caption: str
    captions: tuple[str, ...]
    labels: dict[str, int] = field(default_factory=dict)
    multilabels: dict[str, np.ndarray] = field(default_factory=dict)
    masks: np.ndarray | None = None
    mask_classes: np.ndarray | None = None
