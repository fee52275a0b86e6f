"""Two augmented views of every image for MSF/CMSF: uint8 crops made in the loader's workers, their
colours changed where the step runs.

CMSF (Sec. 2.1.2): "By default both CMSF and SupCon use Weak/strong augmentation" from MSF
(Koohpayegani et al., 2021): the target (momentum) encoder sees the weak view T1, the online
encoder the strong view T2 (Fig. 1). The paper gives no parameters; ours are those of MSF's and
CMSF's released training code (``augmentation_weak`` / ``augmentation_strong``), whose strong view
is MoCo v2's (:class:`ViewRecipe`'s defaults):

    weak   (target u): RandomResizedCrop(scale=(0.2, 1.0)), horizontal flip p=0.5
    strong (online v): RandomResizedCrop(scale=(0.2, 1.0)),
                       ColorJitter(brightness=0.4, contrast=0.4, saturation=0.4, hue=0.1) with p=0.8,
                       grayscale p=0.2, Gaussian blur σ ∈ [0.1, 2.0] px with p=0.5, horizontal flip p=0.5

No solarisation: neither the paper nor that code uses it (BYOL's second view does, p=0.2; set
``solarize_p`` to have it, threshold 0.5, last). BYOL's jitter (saturation 0.2) is
``jitter=(0.4, 0.4, 0.2, 0.1)``. Crops keep the aspect ratio in [3/4, 4/3] (torchvision's default,
used by that code).

Where each part runs, and why (float32 views made in the workers by kornia cost 4.5 CPU-seconds
per 256 images at 224 px, and crossed shared memory, pinning and PCIe at 308 MB a batch):

- **In the workers, on uint8** (:func:`crop_views`): both random resized crops and flips, and the
  strong view's colour parameters, a few numbers a row. A crop is the box of the decoded image (the
  whole image, as the code crops it: no resize to a fixed side first) resampled once to S×S,
  bilinear, antialiased when it shrinks (``F.interpolate`` on uint8), and rounded to uint8: within
  one level of what the code's torchvision ``RandomResizedCrop`` makes of a PIL image (crop, then
  Pillow's bilinear resize; tested), whose output is uint8 too, so the rounding is the reference's
  own. A batch is uint8 ``[B, 2, 3, S, S]`` (:class:`ViewCrops`), a quarter of float32's bytes.
- **Where the step runs, in float32** (:func:`finish_views`; on the GPU by
  :class:`nclip.data.device_feed.DeviceFeed`): colour jitter, grayscale, blur and solarisation of
  the strong view, batched (torchvision's formulas with per-row factors, each step taken or not per
  row by ``torch.where``: no host read, no shape that depends on the data), then CLIP's
  normalisation of both views. Nothing is rounded between the colour steps (the code's PIL steps
  round to uint8 after each).

The strong view's flip is made in the worker although the code flips last: a horizontal flip
commutes with every colour step (pixel-wise, or a per-image mean) and with the blur (a symmetric
kernel, reflected borders), so the view is the same (tested).

Randomness: row i of the global batch of step t draws its crops, flips and colour parameters from
``numpy.random.default_rng([*key, i])``, ``key = (seed, stream, t)`` (the loader's). The jitter's
order is drawn once per batch, from ``default_rng(key)``, as kornia's ``ColorJitter`` drew it once
per call before (torchvision draws one per image: a per-row order would compute each of the four
steps at each of the four places, the hue's round trip four times). A row's views are thus a
function of (seed, step, global row) alone: a batch split over ranks gets the views of the whole
batch in one process, a resumed run those of an uninterrupted one, and the parameters are the same
whatever device finishes the views. The colour steps work per row (a per-image mean, a per-row blur
kernel), so on the CPU a row's floats do not depend on the batch it is in either (tested).

The blur kernel is truncated at 3σ_max (13 taps for σ_max = 2), where the code's PIL blur is
untruncated; each jitter step is clipped to [0, 1] as torchvision's (the hue shift stays within
a pixel's min and max).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from nclip.data.transforms import clip_stats, random_resized_crop_box

# columns of ViewCrops.params: the strong (online) view's colour parameters of a row
JITTER, BRIGHTNESS, CONTRAST, SATURATION, HUE, GRAY, BLUR, SIGMA, SOLARIZE = range(9)
N_PARAMS = 9


@dataclass(frozen=True)
class ViewRecipe:
    """The weak and strong views (module docstring): output side, crop, and the strong view's
    colour steps with their probabilities."""

    size: int = 224
    crop_scale: tuple[float, float] = (0.2, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    jitter: tuple[float, float, float, float] = (0.4, 0.4, 0.4, 0.1)  # brightness, contrast, saturation, hue
    jitter_p: float = 0.8
    grayscale_p: float = 0.2
    blur_sigma: tuple[float, float] = (0.1, 2.0)
    blur_p: float = 0.5
    solarize_p: float = 0.0

    def __post_init__(self):
        if self.size <= 0:
            raise ValueError(f"size must be positive, got {self.size}")
        probs = {"jitter_p": self.jitter_p, "grayscale_p": self.grayscale_p, "blur_p": self.blur_p,
                 "solarize_p": self.solarize_p}
        for name, p in probs.items():
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {p}")
        if not 0 < self.blur_sigma[0] <= self.blur_sigma[1]:
            raise ValueError(f"blur_sigma must be 0 < low <= high, got {self.blur_sigma}")
        if min(self.jitter) < 0 or self.jitter[3] > 0.5:
            raise ValueError(f"jitter strengths must be >= 0 with hue <= 0.5, got {self.jitter}")

    @property
    def taps(self) -> int:
        """The blur kernel's size: ±3σ_max, within the image (reflected borders need radius < S)."""
        return 2 * min(math.ceil(3 * self.blur_sigma[1]), self.size - 1) + 1

    def jitter_order(self, rng: np.random.Generator) -> tuple[int, ...]:
        """The batch's order of the jitter steps (0 brightness, 1 contrast, 2 saturation, 3 hue);
        a step of strength 0 is left out, as torchvision does."""
        return tuple(int(k) for k in rng.permutation(4) if self.jitter[k] > 0)

    def draw(self, rng: np.random.Generator, height: int, width: int):
        """One row's (online box, online flip, target box, target flip, colour parameters
        float32 [N_PARAMS]); boxes are (left, top, right, bottom). Every draw is made whatever the
        probabilities, so that each row reads its generator the same way."""
        online = random_resized_crop_box(height, width, self.crop_scale, self.crop_ratio, rng)
        online_flip = rng.random() < 0.5
        b, c, s, h = self.jitter
        params = np.empty(N_PARAMS, dtype=np.float32)
        params[JITTER] = rng.random() < self.jitter_p
        params[BRIGHTNESS] = rng.uniform(max(0.0, 1 - b), 1 + b)
        params[CONTRAST] = rng.uniform(max(0.0, 1 - c), 1 + c)
        params[SATURATION] = rng.uniform(max(0.0, 1 - s), 1 + s)
        params[HUE] = rng.uniform(-h, h)  # turns
        params[GRAY] = rng.random() < self.grayscale_p
        params[BLUR] = rng.random() < self.blur_p
        params[SIGMA] = rng.uniform(*self.blur_sigma)
        params[SOLARIZE] = rng.random() < self.solarize_p
        target = random_resized_crop_box(height, width, self.crop_scale, self.crop_ratio, rng)
        target_flip = rng.random() < 0.5
        return online, online_flip, target, target_flip, params


class ViewCrops(NamedTuple):
    """A batch's two views as the workers make them; :func:`finish_views` turns them into pixels."""

    pixels: torch.Tensor  # uint8 [B, 2, 3, S, S]: the online (strong) view's crop, the target (weak) view
    params: torch.Tensor  # float32 [B, N_PARAMS]: the online view's colour parameters, per row
    order: tuple[int, ...]  # the jitter steps' order, the batch's
    recipe: ViewRecipe


def crop_views(images: Sequence[np.ndarray], recipe: ViewRecipe, key: Sequence[int], first_row: int = 0) -> ViewCrops:
    """uint8 [H, W, 3] images (any sizes) → their :class:`ViewCrops`: row i is row ``first_row + i``
    of a batch whose randomness is ``key`` (module docstring)."""
    s = recipe.size
    pixels = torch.empty(len(images), 2, 3, s, s, dtype=torch.uint8)
    params = np.empty((len(images), N_PARAMS), dtype=np.float32)
    for i, image in enumerate(images):
        rng = np.random.default_rng([*key, first_row + i])
        online, online_flip, target, target_flip, params[i] = recipe.draw(rng, image.shape[0], image.shape[1])
        chw = torch.from_numpy(image if image.flags.writeable else image.copy()).permute(2, 0, 1)  # a view
        _crop_into(pixels[i, 0], chw, online, online_flip)
        _crop_into(pixels[i, 1], chw, target, target_flip)
    order = recipe.jitter_order(np.random.default_rng(list(key)))
    return ViewCrops(pixels, torch.from_numpy(params), order, recipe)


def _crop_into(out: torch.Tensor, image: torch.Tensor, box: tuple[int, int, int, int], flip: bool) -> None:
    """``out`` uint8 [3, S, S] ← ``box`` of ``image`` uint8 [3, H, W], resized (bilinear, antialiased
    when it shrinks, as Pillow's resize of the cropped image) and flipped horizontally if ``flip``."""
    left, top, right, bottom = box
    region = image[:, top:bottom, left:right]
    if region.shape[1:] != out.shape[1:]:
        region = F.interpolate(region[None], size=tuple(out.shape[1:]), mode="bilinear", antialias=True,
                               align_corners=False)[0]
    out.copy_(region.flip(-1) if flip else region)


def finish_views(crops: ViewCrops, stats: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """:class:`ViewCrops` → normalised float32 pixels [B, 2, 3, S, S] (online/strong view first,
    target/weak view second), where ``crops`` live; ``stats``: CLIP's (mean, std) there
    (:func:`nclip.data.transforms.clip_stats`, made once). The weak view is bitwise
    :func:`nclip.data.transforms.normalize_pixels` of its crop."""
    mean, std = stats if stats is not None else clip_stats(crops.pixels.device)
    online = photometric(crops.pixels[:, 0].float() / 255.0, crops.params, crops.order, crops.recipe)
    views = torch.stack([online, crops.pixels[:, 1].float() / 255.0], dim=1)
    return (views - mean) / std


def photometric(x: torch.Tensor, params: torch.Tensor, order: Sequence[int], recipe: ViewRecipe) -> torch.Tensor:
    """The strong view's colour steps on float [B, 3, S, S] in [0, 1], in the code's order: colour
    jitter (``order``; brightness, contrast, saturation, hue by torchvision's formulas), grayscale,
    Gaussian blur, solarisation; each row's factors and on/off flags from ``params`` [B, N_PARAMS]
    on ``x``'s device. Steps of probability 0 are not computed."""
    steps = (adjust_brightness, adjust_contrast, adjust_saturation, adjust_hue)
    params = params.to(x.dtype)

    def on(column: int) -> torch.Tensor:  # [B, 1, 1, 1]: the row takes this step
        return (params[:, column] > 0.5).view(-1, 1, 1, 1)

    if recipe.jitter_p > 0 and order:
        y = x
        for k in order:
            y = steps[k](y, params[:, BRIGHTNESS + k])
        x = torch.where(on(JITTER), y, x)
    if recipe.grayscale_p > 0:
        x = torch.where(on(GRAY), grayscale(x).expand_as(x), x)
    if recipe.blur_p > 0:
        x = torch.where(on(BLUR), gaussian_blur(x, params[:, SIGMA], recipe.taps), x)
    if recipe.solarize_p > 0:
        x = torch.where(on(SOLARIZE), torch.where(x < 0.5, x, 1.0 - x), x)
    return x


def grayscale(x: torch.Tensor) -> torch.Tensor:
    """float [B, 3, H, W] → [B, 1, H, W] luma, torchvision's weights (ITU-R 601-2)."""
    return 0.2989 * x[:, 0:1] + 0.587 * x[:, 1:2] + 0.114 * x[:, 2:3]


def _blend(x: torch.Tensor, other: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """torchvision's ``_blend``: factor·x + (1 − factor)·other, clipped to [0, 1]; ``factor`` [B]."""
    f = factor.view(-1, 1, 1, 1)
    return (f * x + (1.0 - f) * other).clamp(0.0, 1.0)


def adjust_brightness(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return (factor.view(-1, 1, 1, 1) * x).clamp(0.0, 1.0)  # the blend with black


def adjust_contrast(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """Blend with the image's mean luma. The mean sums the rows, then the columns: a reduction of
    each image to one number is split over threads when the batch holds one image (two-pass), and
    would then not be bitwise the same image's in a larger batch."""
    gray = grayscale(x)
    mean = gray.sum(-1, keepdim=True).sum(-2, keepdim=True) / (x.shape[-2] * x.shape[-1])
    return _blend(x, mean, factor)


def adjust_saturation(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return _blend(x, grayscale(x), factor)


def adjust_hue(x: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
    """torchvision's ``adjust_hue`` (a shift of the HSV hue by ``turns`` [B], V and S kept) on float
    [B, 3, H, W] in [0, 1], without building HSV: a pixel keeps its max V and chroma C = V − min, and
    channel n of hue H (in sextants) is V − C·clamp(min(k, 4 − k), 0, 1) with k = (n + H) mod 6
    (n = 5, 3, 1 for R, G, B). The values of ``kornia.enhance.adjust_hue`` (tested) in half its
    elementwise passes, without its chain of ``where`` per channel."""
    r, g, b = x[:, 0:1], x[:, 1:2], x[:, 2:3]
    v, low = x.amax(1, keepdim=True), x.amin(1, keepdim=True)
    chroma = v - low
    safe = torch.where(chroma > 0, chroma, torch.ones_like(chroma))
    hue = torch.where(v == r, (g - b) / safe, torch.where(v == g, 2.0 + (b - r) / safe, 4.0 + (r - g) / safe))
    hue = hue + 6.0 * turns.view(-1, 1, 1, 1)  # sextants
    n = torch.arange(5, 0, -2, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)  # 5, 3, 1
    k = torch.remainder(hue + n, 6.0)
    return v - chroma * torch.minimum(k, 4.0 - k).clamp(0.0, 1.0)


def gaussian_blur(x: torch.Tensor, sigma: torch.Tensor, taps: int) -> torch.Tensor:
    """float [B, C, H, W] blurred by a Gaussian of standard deviation ``sigma`` [B] (pixels, one per
    row, on ``x``'s device: kornia's ``gaussian_blur2d`` checks a tensor σ on the host) truncated
    to ``taps`` (odd), borders reflected; separable, one depthwise convolution per axis."""
    b, c, h, w = x.shape
    r = taps // 2
    offsets = torch.arange(-r, r + 1, device=x.device, dtype=x.dtype)
    kernel = torch.exp(-(offsets**2) / (2 * sigma.view(-1, 1) ** 2))  # [B, taps]
    kernel = (kernel / kernel.sum(-1, keepdim=True)).repeat_interleave(c, dim=0)  # [B·C, taps]
    y = F.pad(x, (r, r, r, r), mode="reflect").reshape(1, b * c, h + 2 * r, w + 2 * r)
    y = F.conv2d(y, kernel.view(b * c, 1, 1, taps), groups=b * c)
    y = F.conv2d(y, kernel.view(b * c, 1, taps, 1), groups=b * c)
    return y.view(b, c, h, w)
