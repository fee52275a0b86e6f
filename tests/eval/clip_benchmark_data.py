"""Non-square test data for CLIP_benchmark copies: class folders and a captions CSV whose images have
every centre-crop overhang residue mod 4 at a given input size, as JPEG, PNG (RGB, RGBA and P) and WebP files."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
from PIL import Image

CLASSES = ("red", "green", "blue", "yellow", "purple", "grey")
_RGB = {"red": (200, 30, 30), "green": (30, 180, 40), "blue": (30, 40, 200), "yellow": (210, 200, 30),
        "purple": (140, 40, 160), "grey": (120, 120, 120)}
FORMATS = (("png", "PNG", {}), ("jpg", "JPEG", {"quality": 90}), ("webp", "WEBP", {"lossless": True}))


def overhang(width: int, height: int, size: int) -> int:
    """The pixels torchvision's Resize(size) leaves past the centre crop on the long side (its
    ``_compute_resized_output_size``: the long side truncated)."""
    short, long = min(width, height), max(width, height)
    return int(size * long / short) - size


def sizes(size: int, n: int) -> list[tuple[int, int]]:
    """``n`` (width, height) pairs, landscape and portrait, resized or not, whose overhangs at
    ``size`` cycle through 0, 1, 2, 3 mod 4 (3 is where the two crop roundings part)."""
    out = []
    for i in range(n):
        short = (size, size + 5, 2 * size + 3)[i % 3]
        long = short + 1
        while overhang(short, long, size) % 4 != i % 4 or long == short:
            long += 1
        long += 4 * (i % 5)  # more overhangs of the same residue
        while overhang(short, long, size) % 4 != i % 4:
            long += 1
        out.append((long, short) if i % 2 else (short, long))
    return out


def in_mode(rgb: np.ndarray, n: int) -> Image.Image:
    """Every third PNG RGBA (a random alpha) and every sixth one P: CLIP_benchmark's readers decode them to
    RGB before its transform, where open_clip's preprocess on the opened file would convert after the crop."""
    image = Image.fromarray(rgb)
    if n % 6 == 3:
        alpha = np.random.default_rng(n).integers(0, 256, rgb.shape[:2], dtype=np.uint8)
        return Image.fromarray(np.dstack([rgb, alpha]))
    return image.quantize(colors=48) if n % 6 == 0 and n else image


def picture(cls: str, width: int, height: int, seed: int) -> np.ndarray:
    """A ``cls``-tinted image with a bright band off-centre, so a one-pixel shift changes the crop."""
    rng = np.random.default_rng(seed)
    img = np.clip(np.array(_RGB[cls]) + rng.normal(0, 45, (height, width, 3)), 0, 255).astype(np.uint8)
    img[:, : max(1, width // 7)] = 255 - img[:, : max(1, width // 7)]
    img[: max(1, height // 5)] //= 3
    return img


def class_folders(root: Path, size: int, per_class: int = 8) -> list[tuple[Path, int, int]]:
    """``root/<class>/<i>.<png|jpg|webp>``; [(path, width, height)]."""
    written = []
    dims = sizes(size, per_class * len(CLASSES))
    for c, cls in enumerate(CLASSES):
        (root / cls).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            w, h = dims[c * per_class + i]
            ext, fmt, kw = FORMATS[(c + i) % len(FORMATS)]
            path = root / cls / f"{i}.{ext}"
            in_mode(picture(cls, w, h, 10 * c + i), c + i if fmt == "PNG" else 0).save(path, format=fmt, **kw)
            written.append((path, w, h))
    return written


def captions_csv(root: Path, size: int, images: int = 24) -> Path:
    """``root/captions.csv`` (``image,caption,caption2``: one or two distinct captions per image)
    and its images under ``root/img/``."""
    (root / "img").mkdir(parents=True, exist_ok=True)
    rows = []
    for n, (w, h) in enumerate(sizes(size, images)):
        cls = CLASSES[n % len(CLASSES)]
        ext, fmt, kw = FORMATS[n % len(FORMATS)]
        Image.fromarray(picture(cls, w, h, 500 + n)).save(root / "img" / f"{n}.{ext}", format=fmt, **kw)
        second = f"picture {n}, mostly {cls}, {w} by {h}" if n % 3 else ""
        rows.append([f"img/{n}.{ext}", f"a {cls} picture number {n}", second])
    path = root / "captions.csv"
    with path.open("w", newline="", encoding="utf-8") as fh:
        csv.writer(fh).writerows([["image", "caption", "caption2"], *rows])
    return path
