"""The frozen second embedding of every training sample, for CMSF's cross-modal constraint
(Sec. 2.3: a frozen encoder of another modality picks the candidates the image search may use).

In the paper the constraint is a frozen RGB encoder constraining the search of a flow encoder;
in nclip the natural second modality is the caption: by default the bundled pretrained MiniLM
sentence encoder embeds every training caption (the same code and disk cache as ProtoCLIP's
external teacher, :mod:`nclip.train.teacher`). A frozen nclip run or model directory may instead
embed the captions with its text tower or the un-augmented training images with its image tower
(its zero-shot head's embedding where it has one, else the backbone features).

Row i of the table is dataset index i of the training split; batches carry the indices of their
samples, so the table is looked up, never recomputed per step. It is derived data (a fixed function
of the data and the frozen encoder): recomputed, or read from the cache, at every start and never
checkpointed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from nclip.config import RunConfig
from nclip.errors import NclipError
from nclip.objectives.base import FrozenEmbedding

MAX_LENGTH, BATCH = 64, 256  # MiniLM: token length of the captions (as ProtoCLIP's teacher), batch size


def _is_nclip_dir(path: Path) -> bool:
    """An nclip run directory (its final model) or model directory, rather than a transformers one
    (both have a config.json; only nclip's has an ``objective`` section)."""
    import json

    from nclip.models.io import CONFIG

    path = path / "model" if (path / "model" / CONFIG).is_file() else path
    try:
        return "objective" in json.loads((path / CONFIG).read_text())
    except (OSError, ValueError):
        return False


def frozen_table(cfg: RunConfig, spec: FrozenEmbedding, device: torch.device | str = "cpu") -> torch.Tensor:
    """[N, Da] float32: ``spec``'s frozen embedding of every sample of the training split."""
    if spec.encoder is not None and not Path(spec.encoder).exists():
        raise NclipError(f"the frozen encoder {spec.encoder} does not exist (a local directory: nothing is downloaded)")
    if spec.encoder is not None and _is_nclip_dir(Path(spec.encoder)):
        return _nclip_table(cfg, Path(spec.encoder), spec.modality, device)
    if spec.modality != "text":
        raise NclipError(f"a {spec.modality} frozen embedding needs an nclip run or model directory, not "
                         f"{spec.encoder or 'the bundled MiniLM'} (a text encoder)")
    from nclip.train.teacher import caption_features

    feats, _ = caption_features(cfg, spec.encoder, MAX_LENGTH, BATCH, device=device,
                                log=lambda s: print(f"nclip: {s}", file=sys.stderr))
    return feats.float()


def _nclip_table(cfg: RunConfig, directory: Path, modality: str, device) -> torch.Tensor:
    from nclip.eval.checkpoint import resolve_checkpoint
    from nclip.eval.features import encode_images, encode_texts

    model = resolve_checkpoint(directory).load(device)  # a run directory (its model/) or a model directory
    if modality == "text":
        from nclip.train.teacher import train_captions

        out = encode_texts(model, train_captions(cfg), device)
    else:
        out = encode_images(model, _train_images(cfg), cfg.data.image_size, device)
    return (out["clip"] if "clip" in out else out["features"]).float().cpu()


def _train_images(cfg: RunConfig) -> list:
    if cfg.data.source == "csv":
        raise NclipError("an image frozen embedding of a csv source is not supported: use the text modality")
    from nclip.data.sources import build_dataset

    samples = build_dataset(cfg, "train")
    return [samples[i].image for i in range(len(samples))]
