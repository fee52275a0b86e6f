"""Batched feature extraction: every head's output for the images and captions of a dataset.

Precision (docs/precision.md): the towers and heads encode under the run's autocast (``autocast``:
the dtype of :func:`nclip.precision.autocast_dtype` for ``train.precision`` on the device, bf16 on
CUDA by default; None: float32), as they train; every output is cast to float32 as it is
collected (:func:`_cat`), so every score computed from them (cosine, nCLIP's −L_CE, the probes)
runs in float32. While training, the other ranks wait at a barrier for this encoding."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from nclip.data.transforms import eval_tensor, model_resize
from nclip.data.types import LabelKind, Sample
from nclip.defaults import EVAL_BATCH_SIZE
from nclip.heads import probe_output
from nclip.objectives.scores import Score
from nclip.precision import to_float32, tower_autocast


@dataclass
class Features:
    """image[key], text[key] for key in "features" and the names of the heads the model has ("clip", "nclip", ...).

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


def _autocast(device, dtype: torch.dtype | None):
    return tower_autocast(torch.device(device), dtype)


@torch.no_grad()
def encode_texts(model, texts: Sequence[str], device, batch_size: int = EVAL_BATCH_SIZE,
                 autocast: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    parts = []
    for i in range(0, len(texts), batch_size):
        ids, mask = model.tokenizer(list(texts[i : i + batch_size]))
        with _autocast(device, autocast):
            parts.append(model.encode_text(ids.to(device), mask.to(device)))
    return _cat(parts)


@torch.no_grad()
def encode_images(model, images: Sequence[np.ndarray], size: int, device, batch_size: int = EVAL_BATCH_SIZE,
                  autocast: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    parts = []
    for i in range(0, len(images), batch_size):
        pixels = torch.stack([eval_tensor(im, size, model_resize(model)) for im in images[i : i + batch_size]])
        with _autocast(device, autocast):
            parts.append(model.encode_image(pixels.to(device)))
    return _cat(parts)


@torch.no_grad()
def extract(model, samples: Sequence[Sample], image_size: int, device, batch_size: int = EVAL_BATCH_SIZE,
            texts: bool = True, autocast: torch.dtype | None = None) -> Features:
    """Every head's output for the images (and, with ``texts``, the reference captions) of ``samples``,
    encoded under ``autocast`` (None: float32) and returned in float32.

    Streamed a batch at a time: only one batch of images is decoded at once (a lazy dataset such as
    ImageNet's 50,000 validation images would not fit in memory decoded), the next batch decoded
    by a thread pool while the model encodes this one (PIL decodes without the GIL)."""
    model.eval()
    parts, captions, owner = [], [], []
    labels: dict[str, list[int]] = {}
    multilabels: dict[str, list[np.ndarray]] = {}
    with ThreadPoolExecutor(max_workers=_DECODE_THREADS) as pool:
        for start, pixels, batch in _decoded_batches(pool, samples, image_size, batch_size, model_resize(model)):
            with _autocast(device, autocast):
                parts.append(model.encode_image(pixels.to(device)))
            for n, s in enumerate(batch, start):
                if texts:
                    captions.extend(s.captions)
                    owner.extend([n] * len(s.captions))
                for k, v in s.labels.items():
                    labels.setdefault(k, []).append(v)
                for k, v in s.multilabels.items():
                    multilabels.setdefault(k, []).append(v)
    return Features(
        image=_cat(parts),
        text=encode_texts(model, captions, device, batch_size, autocast) if captions else {},
        text_to_image=torch.tensor(owner, dtype=torch.long),
        labels={k: torch.tensor(v) for k, v in labels.items()},
        multilabels={k: torch.from_numpy(np.stack(v)) for k, v in multilabels.items()},
    )


_DECODE_THREADS = min(8, os.cpu_count() or 1)


def _decoded_batches(pool: ThreadPoolExecutor, samples: Sequence[Sample], size: int, batch_size: int,
                     resize: tuple[str, str]):
    """(first index, pixels [b, 3, size, size], the batch's samples with their images dropped) per
    batch, in order; the next batch is decoding while the caller encodes this one."""

    def load(i: int) -> tuple[torch.Tensor, Sample]:
        s = samples[i]
        return eval_tensor(s.image, size, resize), replace(s, image=_NO_IMAGE)

    def submit(start: int):
        return start, [pool.submit(load, i) for i in range(start, min(start + batch_size, len(samples)))]

    pending = submit(0) if len(samples) else None
    while pending is not None:
        start, futures = pending
        nxt = start + batch_size
        pending = submit(nxt) if nxt < len(samples) else None
        loaded = [f.result() for f in futures]
        yield start, torch.stack([p for p, _ in loaded]), [s for _, s in loaded]


_NO_IMAGE = np.zeros((0, 0, 3), np.uint8)  # a sample's image once it is encoded: not kept in memory


def similarity(image: dict[str, torch.Tensor], text: dict[str, torch.Tensor], score: Score) -> torch.Tensor:
    """[N_img, N_txt] zero-shot scores of image against text (or class) outputs, both keyed by head
    name, by ``score`` (:class:`nclip.objectives.scores.Score`: it reads its head's outputs and
    compares them: CLIP's cosine, nCLIP's −L_CE, yCLIP's S, or a plugin's own)."""
    return score.compare(image[score.head], text[score.head])


def zero_shot_embedding(outputs: dict[str, torch.Tensor], score: Score | None, probe_features: str) -> torch.Tensor:
    """[N, D] the embedding of the zero-shot ``score`` (the plan's ``zero_shot``) from a batch's head
    outputs (:meth:`Score.embed`: the CLIP head's embedding ℓ2-normalised, so that the cosine is the
    dot product; the nCLIP head's logits h as they are, since nCLIP's −L_CE reads their softmax). An
    image-only objective (``score`` None) gives its ``probe_features``, ℓ2-normalised. What
    ``nclip.load(...).encode_image`` / ``encode_text`` return and ``nclip embed`` stores."""
    if score is None:
        return F.normalize(outputs[probe_output(probe_features)], dim=-1)
    return score.embed(outputs[score.head])


@torch.no_grad()
def prompt_outputs(model, space: LabelKind, device, autocast: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every prompt's text output, class-major: [C * T, ...] for C classes and T templates."""
    prompts = [p for c in range(len(space)) for p in space.prompts(c)]
    return encode_texts(model, prompts, device, autocast=autocast)


def ensemble(prompts: dict[str, torch.Tensor], num_classes: int, score: Score) -> dict[str, torch.Tensor]:
    """One output per class, ``{score.head: [C, ...]}``, from its prompts' outputs ``prompts[head]``
    [C * T, ...] (class-major), ensembled as ``score`` does (:meth:`Score.ensemble`: CLIP's
    normalised mean of normalised prompt embeddings; for the nCLIP head the log of the mean of the
    prompts' distributions)."""
    value = prompts[score.head]
    return {score.head: score.ensemble(value.view(num_classes, -1, *value.shape[1:]))}  # [C, T, ...] in


@torch.no_grad()
def class_text_outputs(model, space: LabelKind, device, score: Score,
                       autocast: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """One text output per class from its prompt ensemble by ``score`` (see :func:`ensemble`), in float32."""
    return ensemble(prompt_outputs(model, space, device, autocast), len(space), score)
