"""Two augmented views of a batch for MSF/CMSF, as batched tensor augmentations (kornia).

CMSF (Sec. 2.1.2): "By default both CMSF and SupCon use Weak/strong augmentation" from MSF
(Koohpayegani et al., 2021): the target (momentum) encoder sees the weak view T1, the online
encoder the strong view T2 (Fig. 1). The paper gives no parameters; ours are those of MSF's and
CMSF's released training code (``augmentation_weak`` / ``augmentation_strong``), whose strong view
is MoCo v2's:

    weak   (target u): RandomResizedCrop(scale=(0.2, 1.0)), horizontal flip p=0.5
    strong (online v): RandomResizedCrop(scale=(0.2, 1.0)),
                       ColorJitter(brightness=0.4, contrast=0.4, saturation=0.4, hue=0.1) with p=0.8,
                       grayscale p=0.2, Gaussian blur σ ∈ [0.1, 2.0] px with p=0.5, horizontal flip p=0.5

No solarisation: neither the paper nor that code uses it (BYOL's second view does, p=0.2; set
``solarize_p`` to have it). BYOL's jitter (saturation 0.2) is ``jitter=(0.4, 0.4, 0.2, 0.1)``. The
output size is the paper's 224 by default; crops keep the aspect ratio in [3/4, 4/3] (torchvision's
default, used by that code). Colour jitter follows torchvision's formulas (kornia's ``ColorJitter``);
the blur kernel is truncated at 3σ_max (13 taps for σ_max = 2), where the code's PIL blur is
untruncated. Images are float [B, 3, H, W] in [0, 1] and stay in [0, 1]; ``normalize=True`` applies
CLIP's mean and std, the statistics of nclip's towers (the code used ImageNet's).

Randomness comes from torch's global generator, which kornia draws from; pass ``seed`` (or a
``torch.Generator`` to draw one from) to make a call reproducible without touching the global state.
``rows=(offset, total)`` says the images are rows [offset, offset + B) of a batch of ``total``: the
augmentation parameters are drawn for all ``total`` rows and this slice's are applied, so a batch
split over ranks gets exactly the views of the whole batch in one process (the trainer's 2-rank =
1-rank rule). Batch-level parameters (the colour-jitter order, which kornia draws once per call)
are then shared by the whole batch as well.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import kornia.augmentation as K
import torch
from torch import nn

from nclip.data.transforms import CLIP_MEAN, CLIP_STD


class Views(NamedTuple):
    target: torch.Tensor  # [B, 3, S, S] weak view T1(x), for the momentum encoder f
    online: torch.Tensor  # [B, 3, S, S] strong view T2(x), for the online encoder g (+ predictor h)


def _check_prob(name: str, p: float) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {p}")


def weak_view(size: int = 224, *, crop_scale: tuple[float, float] = (0.2, 1.0),
              crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> K.AugmentationSequential:
    """MSF's weak augmentation: random resized crop to size×size and a horizontal flip."""
    if size <= 0:
        raise ValueError(f"size must be positive, got {size}")
    return K.AugmentationSequential(
        K.RandomResizedCrop((size, size), scale=crop_scale, ratio=crop_ratio),
        K.RandomHorizontalFlip(p=0.5),
    )


def strong_view(
    size: int = 224,
    *,
    crop_scale: tuple[float, float] = (0.2, 1.0),
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3),
    jitter: tuple[float, float, float, float] = (0.4, 0.4, 0.4, 0.1),
    jitter_p: float = 0.8,
    grayscale_p: float = 0.2,
    blur_sigma: tuple[float, float] = (0.1, 2.0),
    blur_p: float = 0.5,
    solarize_p: float = 0.0,
) -> K.AugmentationSequential:
    """MSF's strong augmentation (MoCo v2's), in the code's order: crop, colour jitter, grayscale,
    blur, flip; solarisation (threshold 0.5) last when ``solarize_p`` > 0."""
    if size <= 0:
        raise ValueError(f"size must be positive, got {size}")
    probs = {"jitter_p": jitter_p, "grayscale_p": grayscale_p, "blur_p": blur_p, "solarize_p": solarize_p}
    for name, p in probs.items():
        _check_prob(name, p)
    if not 0 < blur_sigma[0] <= blur_sigma[1]:
        raise ValueError(f"blur_sigma must be 0 < low <= high, got {blur_sigma}")
    kernel = 2 * math.ceil(3 * blur_sigma[1]) + 1  # ±3σ_max
    steps = [
        K.RandomResizedCrop((size, size), scale=crop_scale, ratio=crop_ratio),
        K.ColorJitter(*jitter, p=jitter_p),
        K.RandomGrayscale(p=grayscale_p),
        K.RandomGaussianBlur(kernel, blur_sigma, border_type="reflect", p=blur_p),
        K.RandomHorizontalFlip(p=0.5),
    ]
    if solarize_p > 0:
        steps.append(K.RandomSolarize(thresholds=0.0, additions=0.0, p=solarize_p))  # threshold exactly 0.5
    return K.AugmentationSequential(*steps)


class TwoViews(nn.Module):
    """images [B, 3, H, W] in [0, 1] → :class:`Views` (target = weak, online = strong), each
    [B, 3, size, size]. Keyword arguments of :func:`strong_view` configure the strong view."""

    def __init__(self, size: int = 224, *, normalize: bool = False, crop_scale: tuple[float, float] = (0.2, 1.0),
                 **strong_kwargs):
        super().__init__()
        self.weak = weak_view(size, crop_scale=crop_scale)
        self.strong = strong_view(size, crop_scale=crop_scale, **strong_kwargs)
        self.normalize = normalize
        self.register_buffer("mean", torch.as_tensor(CLIP_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.as_tensor(CLIP_STD).view(1, 3, 1, 1), persistent=False)

    @torch.no_grad()
    def forward(self, images: torch.Tensor, *, seed: int | None = None,
                generator: torch.Generator | None = None, rows: tuple[int, int] | None = None) -> Views:
        if images.ndim != 4 or images.shape[1] != 3 or not images.is_floating_point():
            raise ValueError(f"images must be float [B, 3, H, W] in [0, 1], got {images.dtype} {tuple(images.shape)}")
        if seed is not None and generator is not None:
            raise ValueError("pass seed or generator, not both")
        if rows is not None and not (0 <= rows[0] and rows[0] + images.shape[0] <= rows[1]):
            raise ValueError(f"rows (offset, total) = {rows} do not hold a slice of {images.shape[0]} rows")
        if generator is not None:
            seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        if seed is None:
            return self._views(images, rows)
        devices = [images.device.index or 0] if images.is_cuda else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            return self._views(images, rows)

    def _views(self, images: torch.Tensor, rows: tuple[int, int] | None = None) -> Views:
        target, online = _apply(self.weak, images, rows), _apply(self.strong, images, rows)
        if self.normalize:
            mean, std = self.mean.to(images), self.std.to(images)
            target, online = (target - mean) / std, (online - mean) / std
        return Views(target, online)


_BATCH_LEVEL = ("forward_input_shape", "order")  # kornia parameters drawn once per call, not per row


def _apply(aug: K.AugmentationSequential, images: torch.Tensor, rows: tuple[int, int] | None) -> torch.Tensor:
    """``aug(images)``; with ``rows = (offset, total)`` the parameters of rows [offset, offset + B) of
    a batch of ``total`` (drawn for all of them, in the same order as one call on the whole batch)."""
    if rows is None:
        return aug(images)
    offset, total = rows
    b = images.shape[0]
    params = aug.forward_parameters(torch.Size((total, *images.shape[1:])))
    for item in params:
        for key, value in item.data.items():
            if key == "forward_input_shape":
                item.data[key] = torch.tensor(images.shape, dtype=value.dtype)
            elif key not in _BATCH_LEVEL and torch.is_tensor(value) and value.ndim and value.shape[0] == total:
                item.data[key] = value[offset : offset + b]
    return aug(images, params=params)
