"""Image transforms with Pillow and NumPy (no torchvision on the default path).

Randomness comes from an explicit ``numpy.random.Generator`` so that the augmentation of sample i
is a pure function of (seed, i): runs are reproducible whatever the number of loader workers, and a
resumed run sees exactly the crops an uninterrupted one would have.

Training pixels travel as uint8 (:func:`to_uint8_tensor`, a quarter of float32's bytes through the
loader's shared memory and the host-to-device copy) and are normalised where the step runs
(:func:`normalize_pixels`, on the GPU by :mod:`nclip.data.device_feed`). This changes no pixel:
:func:`augment` already returns uint8 (its float colour steps round to uint8 as they end, as
OpenCLIP's PIL pipeline is uint8 until ``ToTensor``), and :func:`normalize_pixels` of those bytes is
bitwise :func:`to_tensor` of them on the CPU. Evaluation keeps :func:`to_tensor`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

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
    if box == (0, 0, image.shape[1], image.shape[0]) and image.shape[:2] == (size, size):
        return image  # Pillow returns a copy for this resize: skip its two conversions (tiny's no-crop)
    return np.asarray(Image.fromarray(image).resize((size, size), Image.BILINEAR, box=box))


# ---------------------------------------------------------------------------------------------
# colour augmentations (SimCLR's, at ProtoCLIP's light probabilities); float RGB in [0, 1]
# ---------------------------------------------------------------------------------------------

_GRAY = np.array([0.299, 0.587, 0.114], dtype=np.float32)  # ITU-R 601-2 luma, as PIL and torchvision


def grayscale(x: np.ndarray) -> np.ndarray:
    """float [H, W, 3] → float [H, W, 1] luma."""
    return (x @ _GRAY)[..., None]


def rgb_to_hsv(x: np.ndarray) -> np.ndarray:
    """float RGB [H, W, 3] in [0, 1] → HSV [H, W, 3] in [0, 1] (hue as a fraction of a turn)."""
    r, g, b = x[..., 0], x[..., 1], x[..., 2]
    maxc, minc = x.max(-1), x.min(-1)
    delta = maxc - minc
    safe = np.where(delta > 0, delta, 1.0)
    h = np.where(maxc == r, (g - b) / safe, np.where(maxc == g, 2.0 + (b - r) / safe, 4.0 + (r - g) / safe))
    h = np.where(delta > 0, (h / 6.0) % 1.0, 0.0)
    sat = np.where(maxc > 0, delta / np.where(maxc > 0, maxc, 1.0), 0.0)
    return np.stack([h, sat, maxc], -1).astype(np.float32)


def hsv_to_rgb(x: np.ndarray) -> np.ndarray:
    """Inverse of :func:`rgb_to_hsv`."""
    h, s, v = x[..., 0], x[..., 1], x[..., 2]
    i = np.floor(h * 6.0)
    f = h * 6.0 - i
    p, q, t = v * (1 - s), v * (1 - s * f), v * (1 - s * (1 - f))
    i = i.astype(np.int64) % 6
    choices = [np.stack(c, -1) for c in ((v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q))]
    return np.choose(i[..., None], choices).astype(np.float32)


def color_jitter(
    image: np.ndarray, strengths: tuple[float, float, float, float], rng: np.random.Generator
) -> np.ndarray:
    """SimCLR/torchvision ColorJitter on uint8 [H, W, 3]: brightness, contrast, saturation factors
    drawn uniformly in [max(0, 1 − s), 1 + s] and a hue shift in [−h, h] turns, applied in a random
    order, each result clipped to [0, 1]."""
    b, c, s, h = strengths
    x = image.astype(np.float32) / 255.0
    for op in rng.permutation(4):
        if op == 0 and b > 0:
            x = np.clip(x * rng.uniform(max(0.0, 1 - b), 1 + b), 0, 1)
        elif op == 1 and c > 0:
            f = rng.uniform(max(0.0, 1 - c), 1 + c)
            x = np.clip(f * x + (1 - f) * grayscale(x).mean(), 0, 1)
        elif op == 2 and s > 0:
            f = rng.uniform(max(0.0, 1 - s), 1 + s)
            x = np.clip(f * x + (1 - f) * grayscale(x), 0, 1)
        elif op == 3 and h > 0:
            hsv = rgb_to_hsv(x)
            hsv[..., 0] = (hsv[..., 0] + rng.uniform(-h, h)) % 1.0
            x = hsv_to_rgb(hsv)
    return np.round(x * 255.0).astype(np.uint8)


def augment(image: np.ndarray, size: int, aug, rng: np.random.Generator) -> np.ndarray:
    """The training augmentation of ``data.augment`` (an AugmentConfig) on uint8 [H, W, 3]:
    random resized crop, optional horizontal flip, colour jitter with ``color_jitter_prob``, then
    grayscale with ``grayscale_prob`` (ProtoCLIP App. A.3 uses 0.2 and 0.2). The colour steps draw
    from ``rng`` only when their probability is non-zero, so the crops of a config without them
    are unchanged."""
    image = random_resized_crop(image, size, aug.crop_scale, aug.crop_ratio, rng)
    if aug.horizontal_flip and rng.random() < 0.5:
        image = image[:, ::-1]
    if aug.color_jitter_prob > 0 and rng.random() < aug.color_jitter_prob:
        image = color_jitter(image, aug.color_jitter, rng)
    if aug.grayscale_prob > 0 and rng.random() < aug.grayscale_prob:
        gray = np.round(grayscale(image.astype(np.float32))).clip(0, 255).astype(np.uint8)
        image = np.repeat(gray, 3, axis=-1)
    return image


INTERPOLATION = {"bicubic": Image.BICUBIC, "bilinear": Image.BILINEAR}
PIL_RESAMPLE = {2: "bilinear", 3: "bicubic"}  # PIL's resample codes, as a preprocessor_config.json names them
# data.eval_convention: whose evaluation pixels a model reproduces. "torchvision": torchvision's Resize and
# CenterCrop on the decoded image, then convert("RGB") -- the preprocess of open_clip, OpenAI's CLIP and
# CLIP_benchmark, which published CLIP numbers use; "transformers": CLIPImageProcessor's PIL backend --
# convert to RGB first (transparency composited onto white), then resize and crop
CONVENTIONS = ("torchvision", "transformers")


class EvalPreprocess(NamedTuple):
    """How evaluation turns an image into the image tower's input: ``resize`` (data.eval_resize),
    ``interpolation`` (data.eval_interpolation) and ``convention`` (data.eval_convention)."""

    resize: str = "shortest"
    interpolation: str = "bicubic"
    convention: str = "torchvision"


EVAL_RESIZE = EvalPreprocess()  # the preprocessing of a model without its own


def preprocess_of(data) -> EvalPreprocess:
    """The EvalPreprocess of a run's data section (a DataConfig)."""
    return EvalPreprocess(data.eval_resize, data.eval_interpolation, data.eval_convention)


def model_resize(model) -> EvalPreprocess:
    """How evaluation pre-processes images for ``model``: a DualEncoder's ``eval_resize`` (its run's
    data.eval_resize, data.eval_interpolation and data.eval_convention)."""
    return EvalPreprocess(*getattr(model, "eval_resize", EVAL_RESIZE))


def center_crop_offset(length: int, size: int, convention: str = "torchvision") -> int:
    """Where a centre crop of ``size`` starts in ``length``: torchvision's CenterCrop rounds half the
    overhang to the nearest integer, ties to even (Python's ``round``); transformers' center_crop
    floors it. The two differ by 1 px when the overhang is 3 (mod 4)."""
    return int(round((length - size) / 2.0)) if convention == "torchvision" else (length - size) // 2


def shortest_side_size(height: int, width: int, size: int) -> tuple[int, int]:
    """(width, height) of the shorter side resized to ``size``: the longer side becomes
    ``int(size * long / short)``, truncated, as torchvision's Resize and CLIPImageProcessor size it."""
    long = int(size * max(height, width) / min(height, width))
    return (size, long) if width <= height else (long, size)


def to_rgb(image: Image.Image, convention: str = "torchvision") -> Image.Image:
    """The image in RGB mode as ``convention`` converts it: PIL's ``convert("RGB")`` (torchvision's
    pipelines, which drop any alpha), or transformers' ``convert_to_rgb``, which composites an image
    with an alpha band or a transparency colour onto white first."""
    if image.mode == "RGB":
        return image
    if convention == "transformers" and ("A" in image.getbands() or image.info.get("transparency") is not None):
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


def eval_resize(image, size: int, mode: str = "shortest", interpolation: str = "bicubic",
                convention: str = "torchvision") -> np.ndarray:
    """Evaluation pre-processing of a PIL image (any mode, as decoded) or a uint8 [H, W, 3] RGB array
    to uint8 [size, size, 3] RGB: ``shortest`` (the shorter side to ``size``, then a centre crop) or
    ``squash`` (both sides to ``size``), with the PIL resize that torchvision's ``Resize`` and
    CLIPImageProcessor call. ``convention`` decides the crop's rounding and whether the mode becomes
    RGB after the crop (torchvision: P images resize by nearest, RGBA ones with their alpha) or
    before the resize (transformers); both pixel for pixel the same as the reference tools."""
    img = image if isinstance(image, Image.Image) else Image.fromarray(np.asarray(image))
    if convention == "transformers":
        img = to_rgb(img, convention)
    target, (left, top) = eval_geometry(img.height, img.width, size, mode, convention)
    if img.size != target:  # torchvision's Resize returns an image of the output size as it is
        img = img.resize(target, INTERPOLATION[interpolation])
    if img.size != (size, size):
        img = img.crop((left, top, left + size, top + size))
    return np.asarray(to_rgb(img, convention))


def eval_geometry(height: int, width: int, size: int, mode: str = "shortest",
                  convention: str = "torchvision") -> tuple[tuple[int, int], tuple[int, int]]:
    """Where :func:`eval_resize` puts an image of ``height`` × ``width``: ((width, height) after the
    resize, (left, top) of the ``size`` × ``size`` crop in it). Masks take the same geometry
    (:func:`nclip.eval.masks.fit_mask`), so that a mask's pixels stay on its image's."""
    target = (size, size) if mode == "squash" else shortest_side_size(height, width, size)
    return target, (center_crop_offset(target[0], size, convention), center_crop_offset(target[1], size, convention))


def resize_center_crop(image, size: int, interpolation: str = "bicubic", convention: str = "torchvision") -> np.ndarray:
    """Evaluation pre-processing with the shorter side to ``size``, then a centre crop (:func:`eval_resize`)."""
    return eval_resize(image, size, "shortest", interpolation, convention)


def describe_eval(size: int, preprocess: EvalPreprocess) -> dict:
    """:func:`eval_tensor`'s pixels as a recipe for code without nclip (an ONNX export's
    onnx_config.json): machine-readable keys, and ``steps``, the same in order as formulas. Each
    key is one decision :func:`eval_resize` takes; following them with PIL and NumPy gives its
    pixels bit for bit."""
    resize, interpolation, convention = preprocess
    resample = INTERPOLATION[interpolation]
    torchvision = convention == "torchvision"
    pil = f"PIL Image.resize(target, {Image.Resampling(resample).name}={int(resample)})"
    to_rgb_step = ('to RGB after the crop: image.convert("RGB") (an alpha band or a transparency colour is dropped)'
                   if torchvision else
                   'to RGB before the resize: an image with an alpha band or a "transparency" in image.info '
                   'becomes Image.alpha_composite(Image.new("RGBA", image.size, (255, 255, 255, 255)), '
                   'image.convert("RGBA")).convert("RGB") (composited onto white), any other image.convert("RGB")')
    resize_step = (f"resize both sides to {size}: {pil}" if resize == "squash" else
                   f"resize the shorter side to {size} and the longer to int({size} * long / short), truncated: "
                   f"{pil}, target (width, height)")
    resize_step += (", in the image's own mode (PIL resizes a P image by nearest neighbour, an RGBA one "
                    "premultiplied by its alpha)" if torchvision else "") + "; none where the image has that size"
    offset = "int(round((L - S) / 2)), Python's round (ties to even)" if torchvision else "(L - S) // 2"
    steps = [*([] if torchvision else [to_rgb_step]), resize_step,
             f"centre crop S x S, S = {size}: left = offset(width), top = offset(height), offset(L) = {offset}",
             *([to_rgb_step] if torchvision else []),
             "pixels = (np.asarray(image).astype(np.float32) / 255 - mean) / std in float32 (mean and std "
             f"float32), [H, W, 3] transposed to [3, {size}, {size}]"]
    return {
        "size": size, "convention": convention, "resize": resize, "interpolation": interpolation,
        "resample": int(resample), "resample_name": Image.Resampling(resample).name,
        "long_side": "truncate",  # int(S * long / short)
        "skip_resize_at_size": True,
        "crop": "center", "crop_rounding": "half_to_even" if torchvision else "floor",
        "convert_rgb": "after_crop" if torchvision else "before_resize",
        "alpha": "dropped" if torchvision else "composited_on_white",
        "divide_by": 255,  # a division, not a product with 1 / 255, which rounds otherwise in float32
        "mean": [float(x) for x in CLIP_MEAN], "std": [float(x) for x in CLIP_STD],
        "dtype": "float32", "layout": "RGB, channels first",
        "steps": steps,
    }


def rgb_array(image) -> np.ndarray:
    """A sample's image as uint8 [H, W, 3] RGB (a PIL image is converted, an array returned as it is)."""
    return np.asarray(image.convert("RGB")) if isinstance(image, Image.Image) else image


def to_tensor(image: np.ndarray) -> torch.Tensor:
    """uint8 [H, W, 3] → float32 [3, H, W], normalised with CLIP's mean and std."""
    x = (image.astype(np.float32) / 255.0 - CLIP_MEAN) / CLIP_STD
    return torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1)))


def to_uint8_tensor(image: np.ndarray) -> torch.Tensor:
    """uint8 [H, W, 3] → uint8 [3, H, W], for :func:`normalize_pixels` where the batch is used."""
    return torch.from_numpy(np.ascontiguousarray(image.transpose(2, 0, 1)))


def clip_stats(device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """CLIP's (mean, std) as float32 [3, 1, 1] tensors on ``device``."""
    return (torch.as_tensor(CLIP_MEAN, device=device).view(3, 1, 1),
            torch.as_tensor(CLIP_STD, device=device).view(3, 1, 1))


def normalize_pixels(pixels: torch.Tensor, stats: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """uint8 [..., 3, H, W] → float32, normalised with CLIP's mean and std on the pixels' device;
    on the CPU bitwise :func:`to_tensor` (the same float32 operations in the same order). ``stats``:
    :func:`clip_stats` made once on that device (on a GPU, building them is a blocking copy)."""
    mean, std = stats if stats is not None else clip_stats(pixels.device)
    return (pixels.float() / 255.0 - mean) / std


def eval_tensor(image, size: int, resize: tuple[str, ...] = ()) -> torch.Tensor:
    """Evaluation pre-processing of one image (a PIL image of any mode, or uint8 [H, W, 3] RGB):
    resize (+ centre crop) + normalise; ``resize``: the model's EvalPreprocess, :func:`model_resize`
    (default: the shorter side, bicubic, torchvision's convention)."""
    return to_tensor(eval_resize(image, size, *resize))
