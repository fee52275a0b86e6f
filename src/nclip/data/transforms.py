"""Image transforms with Pillow and NumPy (no torchvision on the default path).

Randomness comes from an explicit ``numpy.random.Generator`` so that the augmentation of sample i
is a pure function of (seed, i): runs are reproducible whatever the number of loader workers, and a
resumed run sees exactly the crops an uninterrupted one would have.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image

# CLIP's normalisation statistics (OpenAI), used by every nclip image tower
CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)
CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)


def random_resized_crop_box(
    height: int, width: int, scale: tuple[float, float], ratio: tuple[float, float], rng: np.random.Generator
) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of a crop covering a random area share in ``scale`` with a random
    aspect ratio in ``ratio`` (log-uniform), the Inception/CLIP recipe; 10 tries, then the largest
    centred crop within ``ratio``."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            left = int(rng.integers(0, width - w + 1))
            top = int(rng.integers(0, height - h + 1))
            return left, top, left + w, top + h
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        h, w = height, int(round(height * ratio[1]))
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


def random_resized_crop(
    image: np.ndarray, size: int, scale: tuple[float, float], ratio: tuple[float, float], rng: np.random.Generator
) -> np.ndarray:
    """uint8 [H, W, 3] → uint8 [size, size, 3]: a random crop (see above) resized bilinearly."""
    box = random_resized_crop_box(image.shape[0], image.shape[1], scale, ratio, rng)
    return np.asarray(Image.fromarray(image).resize((size, size), Image.BILINEAR, box=box))


def resize_center_crop(image: np.ndarray, size: int) -> np.ndarray:
    """Evaluation pre-processing: shorter side to ``size`` (bicubic), then a centre crop."""
    h, w = image.shape[:2]
    if (h, w) != (size, size):
        s = size / min(h, w)
        img = Image.fromarray(image).resize((max(size, round(w * s)), max(size, round(h * s))), Image.BICUBIC)
        left, top = (img.width - size) // 2, (img.height - size) // 2
        image = np.asarray(img.crop((left, top, left + size, top + size)))
    return image


def to_tensor(image: np.ndarray) -> torch.Tensor:
    """uint8 [H, W, 3] → float32 [3, H, W], normalised with CLIP's mean and std."""
    x = (image.astype(np.float32) / 255.0 - CLIP_MEAN) / CLIP_STD
    return torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1)))
