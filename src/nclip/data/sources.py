"""The datasets a run's ``data.source`` names: the built-in scenes and digits (any split) and a
``folder`` source's training set. CSV and WebDataset sources are read by their own modules
(:mod:`nclip.data.csv_source`, :mod:`nclip.data.webdataset`)."""

from __future__ import annotations

from typing import Sequence

from nclip.config import RunConfig
from nclip.data.types import Sample
from nclip.errors import NclipError

MAIN_LABEL = {"synthetic": "shape", "digits": "digit"}  # the label kind used when none is named


def build_dataset(cfg: RunConfig, split: str, length: int | None = None) -> Sequence[Sample]:
    """A built-in dataset (synthetic scenes or digits) for ``split``, or a ``folder`` source's
    training set."""
    d = cfg.data
    if d.source == "folder" and split == "train":
        from nclip.data.folders import folder_train_samples

        return folder_train_samples(d.folder)
    if d.source == "synthetic":
        from nclip.data.synthetic import SyntheticScenes

        return SyntheticScenes(
            split=split,
            length=length or d.train_length,
            seed=cfg.seed,
            image_size=d.image_size,
            max_objects=d.max_objects,
            loose_caption_prob=d.loose_caption_prob if split == "train" else 0.0,
            hard_negative_group=d.hard_negative_group if split == "train" else 1,
        )
    if d.source == "digits":
        from nclip.data.digits import DigitsPairs

        return DigitsPairs(split=split, seed=cfg.seed, image_size=d.image_size)
    if d.source in ("webdataset", "csv", "folder"):
        raise NclipError(f"data.source {d.source} has no built-in {split!r} split with labels; evaluate "
                         "on a built-in dataset or your own evaluation set instead")
    raise NclipError(f"unknown data source {d.source!r}")  # pragma: no cover - validated
