"""dHash de-duplication (OmniBenchmark Sec. 3.4): hashing speed on one core, and recall / false
positives of planted near-copies.

    python benchmarks/bench_dedup.py [--n 200] [--speed-n 400]

Speed: images/s on one pinned core for JPEGs of 256x256 and 500x375 natural-ish pictures --
decode + dHash (what ``nclip data dedup`` does per file), decode only, dHash of a decoded image,
and, for comparison only, decode with libjpeg's DCT scaling (``Image.draft``), which nclip does not
use. The issue's target is 1,000 images/s/core.

Quality: N distinct originals of each family (synthetic scenes at 128 px, scikit-learn digits
upsampled to 64 px, smooth random "natural-ish" pictures at 256 px) form the reference; the target
holds, per original, a copy resized 0.5x and 2x, re-compressed as JPEG quality 50, and cropped by
2 % and 5 % (of each side, then resized back), plus N distinct images per family that are not in
the reference. Recall: share of copies matched to their own original within D bits; false
positives: share of the distinct target images matched to any reference image. Nothing is asserted.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import io  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

DISTANCES = (0, 4, 8, 10)


def natural(rng: np.random.Generator, size: tuple[int, int]) -> Image.Image:
    """Sum of upsampled noise at a few scales: smooth regions and some texture, like a photo's spectrum."""
    w, h = size
    out = np.zeros((h, w, 3), np.float32)
    for cells, weight in ((4, 1.0), (12, 0.5), (40, 0.25)):
        noise = rng.random((max(2, cells * h // w), cells, 3)).astype(np.float32)
        out += weight * np.asarray(Image.fromarray((noise * 255).astype(np.uint8)).resize(size, Image.BICUBIC))
    return Image.fromarray(np.clip(out / 1.75, 0, 255).astype(np.uint8))


def jpeg(image: Image.Image, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def rate(fn, items) -> float:
    fn(items[0])  # warm up
    start = time.process_time()
    for x in items:
        fn(x)
    return len(items) / (time.process_time() - start)


def speed(n: int) -> list[tuple[str, str, float]]:
    from nclip.data.dedup import dhash_code

    def decode(b):
        with Image.open(io.BytesIO(b)) as im:
            im.load()
            return im

    def decode_hash(b):
        with Image.open(io.BytesIO(b)) as im:
            return dhash_code(im)

    def draft_hash(b):
        with Image.open(io.BytesIO(b)) as im:
            im.draft("L", (64, 64))
            return dhash_code(im)

    rng = np.random.default_rng(0)
    rows = []
    for size in ((256, 256), (500, 375)):
        blobs = [jpeg(natural(rng, size)) for _ in range(n)]
        decoded = [decode(b) for b in blobs[: n // 2]]
        tag = f"{size[0]}x{size[1]}"
        gap = np.array([np.unpackbits(decode_hash(b) ^ draft_hash(b)).sum() for b in blobs])
        print(f"  {tag}: draft decoding changes the hash by {gap.mean():.2f} bits on average "
              f"(identical for {np.mean(gap == 0):.0%} of the images)")
        rows += [(tag, "decode JPEG + dHash (nclip)", rate(decode_hash, blobs)),
                 (tag, "decode JPEG only", rate(decode, blobs)),
                 (tag, "dHash of a decoded RGB image", rate(dhash_code, decoded)),
                 (tag, "decode with draft(L, 64px) + dHash (not used)", rate(draft_hash, blobs))]
    return rows


def families(n: int) -> dict[str, list[Image.Image]]:
    """2n distinct images per family: the first n originals, the last n distinct targets."""
    from nclip.data.digits import DigitsPairs
    from nclip.data.synthetic import SyntheticScenes

    scenes = SyntheticScenes("train", length=2 * n, image_size=128, loose_caption_prob=0.0)
    digits = DigitsPairs("train", image_size=64)
    rng = np.random.default_rng(1)
    return {"synthetic 128px": [Image.fromarray(scenes[i].image) for i in range(2 * n)],
            "digits 64px": [Image.fromarray(digits[i].image) for i in range(min(2 * n, len(digits)))],
            "natural-ish 256px": [natural(rng, (256, 256)) for _ in range(2 * n)]}


def crop(image: Image.Image, share: float) -> Image.Image:
    w, h = image.size
    dx, dy = max(1, round(w * share)), max(1, round(h * share))
    return image.crop((dx, dy, w - dx, h - dy)).resize((w, h), Image.BICUBIC)


TRANSFORMS = {
    "resize 0.5x": lambda im: im.resize((im.width // 2, im.height // 2), Image.BICUBIC),
    "resize 2x": lambda im: im.resize((im.width * 2, im.height * 2), Image.BICUBIC),
    "JPEG q50": lambda im: Image.open(io.BytesIO(jpeg(im, 50))),
    "crop 2%": lambda im: crop(im, 0.02),
    "crop 5%": lambda im: crop(im, 0.05),
}


def quality(n: int) -> list[tuple[str, str, list[float]]]:
    from nclip.data.dedup import dhash_code, find_duplicates

    rows = []
    for family, images in families(n).items():
        half = len(images) // 2
        originals, distinct = images[:half], images[half:]
        ref = np.stack([dhash_code(im) for im in originals])
        for name, fn in TRANSFORMS.items():
            tgt = np.stack([dhash_code(fn(im)) for im in originals])
            recall = []
            for d in DISTANCES:
                own = {(t, r) for t, r, _ in find_duplicates(ref, tgt, d) if t == r}
                recall.append(len(own) / half)
            rows.append((family, name, recall))
        tgt = np.stack([dhash_code(im) for im in distinct])
        rows.append((family, "false positives (distinct)",
                     [len({t for t, _, _ in find_duplicates(ref, tgt, d)}) / len(distinct) for d in DISTANCES]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200, help="originals (and distinct targets) per family")
    parser.add_argument("--speed-n", type=int, default=400, help="JPEGs per size for the speed rows")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):  # one core: the figures are per core
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

    print("hashing speed, one core (CPU time), target 1,000 images/s/core")
    for size, what, r in speed(args.speed_n):
        print(f"  {size:<8} {what:<48} {r:8.0f} images/s  ({r / 1000:.2f}x target)")
    print(f"\nshare matched, {args.n} originals per family: recall of copies to their own original; "
          "false positives: distinct target images matched to any reference image")
    print(f"  {'family':<18} {'target':<28}" + "".join(f"  D<={d:<3}" for d in DISTANCES))
    for family, name, values in quality(args.n):
        print(f"  {family:<18} {name:<28}" + "".join(f"  {v:6.3f}" for v in values))


if __name__ == "__main__":
    main()
