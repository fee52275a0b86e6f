"""Batched feature extraction: every head's output for the images and captions of a dataset."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from nclip.data.loader import eval_tensor
from nclip.data.types import LabelSpace, Sample
from nclip.defaults import EVAL_BATCH_SIZE
from nclip.objectives.functional import nclip_similarity, yclip_similarity
from nclip.precision import to_float32


@dataclass
class Features:
    """image[key], text[key] for key in features / emb / logits (the heads the model has).

    image tensors are [N, ...] for N images; text tensors are [M, ...] for the M reference captions,
    ``text_to_image`` [M] maps each caption to its image; labels[kind] are [N] class indices and
    multilabels[kind] are bool [N, C].
    """

    image: dict[str, torch.Tensor]
    text: dict[str, torch.Tensor]
    text_to_image: torch.Tensor
    labels: dict[str, torch.Tensor]
    multilabels: dict[str, torch.Tensor]


def _cat(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Batches of head outputs joined, on the CPU, in float32: every score computed from them (cosine,
    nCLIP's −L_CE, probes) runs in float32 whatever precision the towers ran in."""
    return {k: to_float32(torch.cat([p[k] for p in parts])).cpu() for k in parts[0]}


@torch.no_grad()
def encode_texts(model, texts: Sequence[str], device, batch_size: int = EVAL_BATCH_SIZE) -> dict[str, torch.Tensor]:
    parts = []
    for i in range(0, len(texts), batch_size):
        ids, mask = model.tokenizer(list(texts[i : i + batch_size]))
        parts.append(model.encode_text(ids.to(device), mask.to(device)))
    return _cat(parts)


@torch.no_grad()
def encode_images(model, images: Sequence[np.ndarray], size: int, device,
                  batch_size: int = EVAL_BATCH_SIZE) -> dict[str, torch.Tensor]:
    parts = []
    for i in range(0, len(images), batch_size):
        pixels = torch.stack([eval_tensor(im, size) for im in images[i : i + batch_size]])
        parts.append(model.encode_image(pixels.to(device)))
    return _cat(parts)


@torch.no_grad()
def extract(model, samples: Sequence[Sample], image_size: int, device, batch_size: int = EVAL_BATCH_SIZE,
            texts: bool = True) -> Features:
    """Every head's output for the images (and, with ``texts``, the reference captions) of ``samples``."""
    model.eval()
    items = [samples[i] for i in range(len(samples))]
    captions, owner = [], []
    if texts:
        for n, s in enumerate(items):
            captions.extend(s.captions)
            owner.extend([n] * len(s.captions))
    return Features(
        image=encode_images(model, [s.image for s in items], image_size, device, batch_size),
        text=encode_texts(model, captions, device, batch_size) if captions else {},
        text_to_image=torch.tensor(owner, dtype=torch.long),
        labels={k: torch.tensor([s.labels[k] for s in items]) for k in items[0].labels} if items else {},
        multilabels={k: torch.from_numpy(np.stack([s.multilabels[k] for s in items])) for k in items[0].multilabels}
        if items else {},
    )


def similarity(image: dict[str, torch.Tensor], text: dict[str, torch.Tensor], head: str,
               nclip_score: str = "symmetric") -> torch.Tensor:
    """[N_img, N_txt] scores with the zero-shot score ``head`` (:data:`nclip.eval.settings.HEADS`):
    ``clip``: cosine of the CLIP-head embeddings; ``nclip``: nCLIP's −L_CE on the nCLIP head (Sec. 3.1,
    Eq. 2), symmetrised by default or one-directional (``nclip_score``, see
    :func:`~nclip.objectives.functional.nclip_similarity`); ``yclip``: yCLIP's own score S on the
    nCLIP head (App. B.2 Eq. 2, :func:`~nclip.objectives.functional.yclip_similarity`)."""
    if head == "clip":
        return F.normalize(image["emb"], dim=-1) @ F.normalize(text["emb"], dim=-1).T
    if head == "nclip":
        return nclip_similarity(image["logits"], text["logits"], nclip_score)
    if head == "yclip":
        return yclip_similarity(image["logits"], text["logits"])
    raise ValueError(f"unknown head {head!r}")


@torch.no_grad()
def prompt_outputs(model, space: LabelSpace, device) -> dict[str, torch.Tensor]:
    """Every prompt's text output, class-major: [C * T, ...] for C classes and T templates."""
    prompts = [p for c in range(len(space)) for p in space.prompts(c)]
    return encode_texts(model, prompts, device)


def ensemble(prompts: dict[str, torch.Tensor], num_classes: int) -> dict[str, torch.Tensor]:
    """One output per class from its prompts' outputs ``prompts[key]`` [C * T, ...] (class-major).

    CLIP head ("emb"): each prompt embedding normalised, averaged per class, renormalised (CLIP's
    ensemble, :func:`metrics.zero_shot_classifier`). nCLIP head ("logits"): the class distribution
    is the mean of its prompts' distributions, whose log is returned as logits (a log-distribution
    is a valid logit vector: softmax(log p̄) = p̄). Backbone "features" are averaged.
    """
    from nclip.eval.metrics import zero_shot_classifier

    classes = {}
    for key, value in prompts.items():
        v = value.view(num_classes, -1, *value.shape[1:])  # [C, T, ...]
        if key == "emb":
            classes[key] = zero_shot_classifier(v)
        elif key == "logits":
            p = F.softmax(v, dim=-1).mean(1)
            classes[key] = p.clamp_min(1e-30).log()
        else:
            classes[key] = v.mean(1)
    return classes


@torch.no_grad()
def class_text_outputs(model, space: LabelSpace, device) -> dict[str, torch.Tensor]:
    """One text output per class from its prompt ensemble (see :func:`ensemble`)."""
    return ensemble(prompt_outputs(model, space, device), len(space))
