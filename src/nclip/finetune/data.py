"""The labelled images of a fine-tuning run, from the evaluation datasets (:mod:`nclip.eval.datasets`).

``digits``, ``synthetic`` (label kind ``shape``) and ``folder:DIR`` give a training and a test split
at the checkpoint's image size, exactly as ``nclip eval`` builds them (a model pre-trained on the
digits is tested on its own held-out digits: :func:`nclip.eval.runner.build_datasets`). The
training split is divided by :func:`nclip.finetune.splits.label_splits`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nclip.data.transforms import eval_tensor, preprocess_of, rgb_array
from nclip.data.types import LabelKind
from nclip.finetune.loop import LabelledData
from nclip.finetune.splits import LabelSplits, label_splits, per_class_counts


@dataclass
class Prepared:
    name: str  # the dataset part of the result keys
    kind: str  # the label kind (digit, shape, class)
    space: LabelKind
    labelled: LabelledData
    test_pixels: torch.Tensor  # [N, 3, S, S]
    test_labels: torch.Tensor  # [N]
    splits: LabelSplits  # rows of the training split
    per_class: list[int]  # labelled training images per class


def prepare(cfg, settings) -> Prepared:
    """The train/val/test data of ``settings.dataset`` for a checkpoint with run config ``cfg``."""
    from nclip.eval.realms import class_kind
    from nclip.eval.runner import build_datasets
    from nclip.eval.settings import EvalSettings

    spec = EvalSettings(tasks=("linear",), datasets=(settings.dataset,), test_samples=settings.test_samples,
                        train_samples=settings.train_samples, seed=settings.seed)
    data = build_datasets(cfg, spec)[0]
    kind = class_kind(data.label_kinds)
    size, resize = cfg.data.image_size, preprocess_of(cfg.data)
    train = [data.splits["train"][i] for i in range(len(data.splits["train"]))]
    test = [data.splits["test"][i] for i in range(len(data.splits["test"]))]
    y = np.array([s.labels[kind] for s in train], dtype=np.int64)
    splits = label_splits(y, settings.fraction, settings.val_fraction, settings.seed)
    labelled = LabelledData(
        train_images=[rgb_array(train[i].image) for i in splits.train],  # augmented as training's RGB arrays
        train_labels=torch.from_numpy(y[splits.train]),
        val_pixels=torch.stack([eval_tensor(train[i].image, size, resize) for i in splits.val]),
        val_labels=torch.from_numpy(y[splits.val]),
        image_size=size)
    return Prepared(data.name, kind, data.label_kinds[kind], labelled,
                    torch.stack([eval_tensor(s.image, size, resize) for s in test]),
                    torch.tensor([s.labels[kind] for s in test], dtype=torch.long), splits,
                    per_class_counts(y, splits.train, len(data.label_kinds[kind])))
