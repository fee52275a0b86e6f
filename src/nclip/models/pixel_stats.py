"""Pixels normalised with CLIP's mean and std (the data layer's) → a tower's own statistics.

A tower started from a model trained with other statistics (``model.vision.pixel_mean`` /
``pixel_std``, read from its preprocessing config) re-normalises its input as one affine map:
x_CLIP·σ_CLIP + μ_CLIP is the raw pixel, so (raw − μ) / σ = x_CLIP·(σ_CLIP/σ) + (μ_CLIP − μ)/σ. The
two buffers are not persistent: the config, not the state dict, holds the statistics.
"""

from __future__ import annotations

import torch
from torch import nn

from nclip.data.transforms import CLIP_MEAN, CLIP_STD


def add(module: nn.Module, mean, std) -> None:
    """Give ``module`` the buffers of :func:`apply` (nothing where ``mean`` is None: CLIP's own)."""
    module.renormalise = mean is not None
    if module.renormalise:
        mean, std = torch.tensor(mean).view(1, 3, 1, 1), torch.tensor(std).view(1, 3, 1, 1)
        clip_mean = torch.from_numpy(CLIP_MEAN).view(1, 3, 1, 1)
        clip_std = torch.from_numpy(CLIP_STD).view(1, 3, 1, 1)
        module.register_buffer("pixel_scale", clip_std / std, persistent=False)
        module.register_buffer("pixel_shift", (clip_mean - mean) / std, persistent=False)


def apply(module: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """``pixels`` [B, 3, H, W] as the tower expects them."""
    if not module.renormalise:
        return pixels
    return pixels * module.pixel_scale.to(pixels.dtype) + module.pixel_shift.to(pixels.dtype)
