"""Protocol 9: mask probing (xCLIP Sec. 4.2.1, App. D.1 / Tab. D3, following DINO Sec. 4.2.1).

For every head of the vision tower's last layer, the attention of the [CLS] query over the patch
tokens is taken as a saliency map, thresholded to keep the patches holding 60% of the attention
mass (DINO's rule), upsampled (nearest) to the mask resolution and compared by Jaccard with the
ground-truth foreground -- on synthetic scenes the union of all object masks, on the user's
``masks:DIR`` (:mod:`nclip.eval.mask_folder`, Pascal VOC 2012 layout as in xCLIP Tab. 12) the
pixels of any class but background, VOC's 255 "void" pixels excluded from intersection and union
(a sample's ``ignore`` mask). Jaccard is averaged over images per head and the best head is
retained (``metrics.attention_mask_jaccard``).

The maps come from the image tower's ``attention_maps`` (:mod:`nclip.models.towers`): [CLS]
attention for the ViT, the attention-pool query's attention for the conv net. A tower whose
``saliency`` is None (the ResNet, average-pooled) has no such map: :func:`unsupported` says why,
and the runner skips the task.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from PIL import Image

from nclip.data.transforms import EVAL_RESIZE, EvalPreprocess, eval_geometry, eval_tensor, model_resize
from nclip.data.types import Sample
from nclip.defaults import EVAL_BATCH_SIZE
from nclip.errors import NclipError
from nclip.eval.metrics import attention_mask_jaccard
from nclip.eval.settings import MASK_THRESHOLD

THRESHOLD = MASK_THRESHOLD  # DINO: keep 60% of the attention mass


def fit_mask(mask: np.ndarray, size: int, preprocess: EvalPreprocess = EVAL_RESIZE) -> np.ndarray:
    """bool [H, W] -> bool [size, size] in its image's eval view: the resize and centre crop that
    ``preprocess`` (the model's, :func:`nclip.data.transforms.model_resize`) gives the image, the
    same arithmetic (:func:`~nclip.data.transforms.eval_geometry`), nearest-neighbour."""
    h, w = mask.shape
    target, (left, top) = eval_geometry(h, w, size, preprocess.resize, preprocess.convention)
    img = Image.fromarray(mask.astype(np.uint8) * 255)
    if img.size != target:
        img = img.resize(target, Image.NEAREST)
    return np.asarray(img.crop((left, top, left + size, top + size))) > 127


def unsupported(vision_kind: str) -> str | None:
    """Why an image tower of ``vision_kind`` cannot be mask-probed (one line), or None if it can."""
    from nclip.models.towers import VISION_TOWERS  # lazy: transformers costs seconds, `eval compare` needs none

    if vision_kind == "groupvit":
        return "the groupvit image tower has no [CLS] or attention-pool map to probe (its groups: --tasks segmentation)"
    if VISION_TOWERS[vision_kind].saliency is None:
        return (f"the {vision_kind} image tower pools without attention: no [CLS] or attention-pool "
                "map over image positions to probe")
    return None


@torch.no_grad()
def extract(model, samples: Sequence[Sample], image_size: int, device,
            batch_size: int = EVAL_BATCH_SIZE) -> dict[str, torch.Tensor]:
    """{"attn": [N, heads, h, w], "masks": bool [N, S, S] (union of the object masks), "ignore": bool
    [N, S, S] (pixels left out of the Jaccard: a sample's ``ignore`` mask, none for built-in scenes)}."""
    model.eval()
    preprocess = model_resize(model)  # the images' and their masks' geometry
    attn, masks, ignore = [], [], []
    for i in range(0, len(samples), batch_size):
        batch = [samples[j] for j in range(i, min(i + batch_size, len(samples)))]
        pixels = torch.stack([eval_tensor(s.image, image_size, preprocess) for s in batch]).to(device)
        attn.append(model.vision.attention_maps(pixels))
        for s in batch:
            if s.masks is None:
                raise NclipError("mask probing needs samples with object masks")
            masks.append(fit_mask(np.asarray(s.masks).any(axis=0), image_size, preprocess))
            void = getattr(s, "ignore", None)
            ignore.append(np.zeros_like(masks[-1]) if void is None
                          else fit_mask(np.asarray(void), image_size, preprocess))
    return {"attn": torch.cat(attn), "masks": torch.from_numpy(np.stack(masks)),
            "ignore": torch.from_numpy(np.stack(ignore))}


def evaluate(attn: torch.Tensor, masks: torch.Tensor, threshold: float = THRESHOLD,
             ignore: torch.Tensor | None = None) -> dict:
    """{"jaccard": best head's mean Jaccard, "best_head", "mean_heads", "per_head": [heads], "per_sample"};
    ``ignore`` bool [N, S, S]: pixels excluded from intersection and union."""
    r = attention_mask_jaccard(attn, masks, threshold=threshold, ignore=ignore)
    return {"jaccard": r["best"], "best_head": r["best_head"], "mean_heads": float(r["per_head"].mean()),
            "per_head": r["per_head"], "per_sample": r["per_sample"]}


def predicted_mask(attn: torch.Tensor, size: int, threshold: float = THRESHOLD) -> torch.Tensor:
    """bool [size, size]: one head's map [h, w] thresholded to ``threshold`` of its mass and
    upsampled (nearest) -- what the Jaccard compares, for drawing in the report. Uses the metric's
    own thresholding rule (ties at the cut are kept) so the picture matches the number."""
    from nclip.eval.metrics import mass_threshold

    keep = mass_threshold(attn.reshape(1, -1).double(), threshold)[0]  # [h*w]
    grid = keep.view(1, 1, *attn.shape).float()
    return torch.nn.functional.interpolate(grid, size=(size, size), mode="nearest")[0, 0] > 0.5
