"""Protocol 9: mask probing (xCLIP Sec. 4.2.1, App. D.1 / Tab. D3, following DINO Sec. 4.2.1).

For every head of the vision tower's last layer, the attention of the [CLS] query over the patch
tokens is taken as a saliency map, thresholded to keep the patches holding 60% of the attention
mass (DINO's rule), upsampled (nearest) to the mask resolution and compared by Jaccard with the
ground-truth foreground -- on synthetic scenes the union of all object masks. Jaccard is averaged
over images per head and the best head is retained (``metrics.attention_mask_jaccard``).

The attention weights come from ``transformers``' ``CLIPVisionModel(output_attentions=True)``.
The fused SDPA kernel the towers use for speed never materialises them (transformers returns an
empty tuple), so the tower is switched to the "eager" implementation for the extraction and
switched back afterwards (:func:`eager_attention`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Sequence

import numpy as np
import torch
from PIL import Image

from nclip.data.loader import eval_tensor
from nclip.data.types import Sample
from nclip.errors import NclipError
from nclip.eval.metrics import attention_mask_jaccard
from nclip.eval.settings import MASK_THRESHOLD

THRESHOLD = MASK_THRESHOLD  # DINO: keep 60% of the attention mass


def _set_impl(module, impl: str) -> None:
    if hasattr(module, "set_attn_implementation"):
        module.set_attn_implementation(impl)
    else:  # older transformers: the attention classes read the config at call time
        module.config._attn_implementation = impl


@contextmanager
def eager_attention(module):
    """Run ``module`` (a transformers model) with eager attention inside the block, then restore."""
    before = getattr(module.config, "_attn_implementation", None) or "eager"
    if before != "eager":
        _set_impl(module, "eager")
    try:
        yield module
    finally:
        if before != "eager":
            _set_impl(module, before)


@torch.no_grad()
def cls_attention(vision_model, pixels: torch.Tensor) -> torch.Tensor:
    """Last-layer attention of [CLS] over the patches: [B, heads, h, w] (rows sum to < 1: the
    weight [CLS] puts on itself is left out, as in DINO)."""
    with eager_attention(vision_model):
        out = vision_model(pixel_values=pixels, output_attentions=True)
    if not out.attentions:
        raise NclipError("the vision tower returned no attention weights (output_attentions)")
    att = out.attentions[-1][:, :, 0, 1:]  # [B, heads, h*w]
    side = int(round(att.shape[-1] ** 0.5))
    if side * side != att.shape[-1]:
        raise NclipError(f"cannot arrange {att.shape[-1]} patch tokens on a square grid")
    return att.reshape(*att.shape[:2], side, side).float().cpu()


def _fit_mask(mask: np.ndarray, size: int) -> np.ndarray:
    """bool [H, W] -> bool [size, size] with the image's eval geometry (shorter side, centre crop)."""
    h, w = mask.shape
    if (h, w) == (size, size):
        return mask
    s = size / min(h, w)
    img = Image.fromarray(mask.astype(np.uint8) * 255).resize((max(size, round(w * s)), max(size, round(h * s))),
                                                              Image.NEAREST)
    left, top = (img.width - size) // 2, (img.height - size) // 2
    return np.asarray(img.crop((left, top, left + size, top + size))) > 127


@torch.no_grad()
def extract(model, samples: Sequence[Sample], image_size: int, device, batch_size: int = 256) -> dict[str, torch.Tensor]:
    """{"attn": [N, heads, h, w], "masks": bool [N, S, S] (union of the object masks)}."""
    model.eval()
    vision = model.vision.model
    attn, masks = [], []
    for i in range(0, len(samples), batch_size):
        batch = [samples[j] for j in range(i, min(i + batch_size, len(samples)))]
        pixels = torch.stack([eval_tensor(s.image, image_size) for s in batch]).to(device)
        attn.append(cls_attention(vision, pixels))
        for s in batch:
            if s.masks is None:
                raise NclipError("mask probing needs samples with object masks")
            masks.append(_fit_mask(np.asarray(s.masks).any(axis=0), image_size))
    return {"attn": torch.cat(attn), "masks": torch.from_numpy(np.stack(masks))}


def evaluate(attn: torch.Tensor, masks: torch.Tensor, threshold: float = THRESHOLD) -> dict:
    """{"jaccard": best head's mean Jaccard, "best_head", "mean_heads", "per_head": [heads], "per_sample"}."""
    r = attention_mask_jaccard(attn, masks, threshold=threshold)
    return {"jaccard": r["best"], "best_head": r["best_head"], "mean_heads": float(r["per_head"].mean()),
            "per_head": r["per_head"], "per_sample": r["per_sample"]}


def predicted_mask(attn: torch.Tensor, size: int, threshold: float = THRESHOLD) -> torch.Tensor:
    """bool [size, size]: one head's map [h, w] thresholded to ``threshold`` of its mass and
    upsampled (nearest) -- what the Jaccard compares, for drawing in the report. Uses the metric's
    own thresholding rule (ties at the cut are kept) so the picture matches the number."""
    from nclip.eval.metrics import _mass_threshold

    keep = _mass_threshold(attn.reshape(1, -1).double(), threshold)[0]  # [h*w]
    grid = keep.view(1, 1, *attn.shape).float()
    return torch.nn.functional.interpolate(grid, size=(size, size), mode="nearest")[0, 0] > 0.5
