"""Near-duplicate removal between a reference set and a target set by difference hash
(OmniBenchmark, Sec. 3.4: "we delete the image that has the same hash-code as any image in these
pre-training datasets").

dHash. The paper uses "Difference Hash (DHash) [2]", Ben Hoyt's write-up: resize to a grey 9×8
image (9 wide, 8 high), compare horizontally adjacent pixels row by row, one bit per pair, 64 bits.
We call ``imagehash.dhash(image, hash_size=8)``, which does exactly that: ``convert("L")``, a
Lanczos resize to (9, 8), then ``bit[r, c] = pixel[r, c + 1] > pixel[r, c]`` (1 where brightness
*increases* to the right). Hoyt's code sets ``left > right`` instead, so for pixels that differ
imagehash's bits are the complement of Hoyt's, and for equal neighbours both give 0. Hamming
distances between two images are therefore the same under either convention except at exactly
equal neighbours (flat regions), and "same hash" means the same thing. A left-to-right brightness
ramp gives all ones (tested). Bits are packed row by row, the leftmost comparison in the most
significant bit (``numpy.packbits``): row r is byte r of the uint8 [N, 8] codes, the same order as
``str(imagehash)``.

Search. Codes go into a faiss binary index and every target code runs one range query, "Hamming
distance <= D" (faiss's radius is strict, so D + 1): ``IndexBinaryFlat`` (exact brute force in
C++, popcount) for small sets, or hash tables that stay exact: D = 0 with ``IndexBinaryHash``
(64-bit buckets, no flips), D > 0 with ``IndexBinaryMultiHash`` (4 tables of 16 bits,
``nflip = D // 4``: by pigeonhole, two codes within D differ in at most D // 4 bits of one of the
four 16-bit parts, so the pair is a candidate and the full distance is then checked).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from nclip.errors import NclipError
from nclip.jsonio import parse_json, read_text

HASH_SIZE = 8  # 8 rows of 8 comparisons: 64 bits
BITS = HASH_SIZE * HASH_SIZE
_CHUNK = 256  # images handed to the thread pool at a time: a streamed source is never read far ahead
_FLAT_MAX_PAIRS = 2e8  # below this many (reference × target) pairs the flat scan is fast enough
_MULTIHASH_MAX_D = 11  # nflip = D // 4 <= 2: at most 137 buckets probed per table


def dhash_code(image: Image.Image) -> np.ndarray:
    """uint8 [8]: the 64-bit dHash of a PIL image, packed row by row (see the module docstring)."""
    import imagehash

    return np.packbits(imagehash.dhash(image, hash_size=HASH_SIZE).hash.reshape(-1))


def _hash_one(opener: Callable[[], Image.Image], fast_jpeg: bool = False) -> np.ndarray | str:
    try:
        with opener() as image:
            if fast_jpeg:  # libjpeg decodes grey at 1/2..1/8 scale (>= 64 px): no effect on other formats
                image.draft("L", (8 * HASH_SIZE, 8 * HASH_SIZE))
            return dhash_code(image)
    except Exception as e:  # PIL raises many types for corrupt or truncated files
        return f"image does not decode: {type(e).__name__}"


@dataclass
class Hashed:
    """The codes of one source: identifiers [N], codes uint8 [N, 8], unreadable items, seconds spent."""

    ids: list[str]
    codes: np.ndarray
    bad: list[tuple[str, str]]
    seconds: float


def hash_images(items: Iterable[tuple[str, Callable[[], Image.Image]]], workers: int = 1,
                fast_jpeg: bool = False) -> Hashed:
    """dHash every (identifier, opener) pair; ``workers`` > 1 hashes in threads (PIL's decoders and
    resize release the GIL). An image that does not decode is listed in ``bad``, not raised.

    ``fast_jpeg``: decode JPEGs with libjpeg's DCT scaling, straight to grey at >= 64 px. About 3x
    faster on 500x375 JPEGs, but it changes about a quarter of the hashes by a bit or so
    (benchmarks/bench_dedup.py): hash both sides the same way and use D >= 2."""
    if workers < 1:
        raise NclipError(f"workers must be >= 1, got {workers}")
    ids, codes, bad = [], [], []
    start = time.perf_counter()
    hash_one = functools.partial(_hash_one, fast_jpeg=fast_jpeg)

    def take(chunk, results):
        for (key, _), out in zip(chunk, results):
            if isinstance(out, str):
                bad.append((key, out))
            else:
                ids.append(key)
                codes.append(out)

    with ThreadPoolExecutor(workers) if workers > 1 else _Inline() as pool:
        chunk: list = []
        for item in items:
            chunk.append(item)
            if len(chunk) == _CHUNK:
                take(chunk, pool.map(hash_one, [opener for _, opener in chunk]))
                chunk = []
        take(chunk, pool.map(hash_one, [opener for _, opener in chunk]))
    arr = np.stack(codes) if codes else np.zeros((0, BITS // 8), np.uint8)
    return Hashed(ids, arr, bad, time.perf_counter() - start)


class _Inline:
    """A sequential stand-in for the thread pool (no thread overhead for one worker)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def map(self, fn, xs):
        return [fn(x) for x in xs]


def build_index(reference: np.ndarray, max_distance: int, method: str = "auto", queries: int = 0):
    """A faiss binary index over uint8 [N, 8] codes whose range search with radius ``max_distance + 1``
    is exact (module docstring). ``method``: flat, hash, or auto (flat for small N × queries or large D)."""
    import faiss

    if method == "auto":
        small = len(reference) * max(queries, 1) <= _FLAT_MAX_PAIRS
        method = "flat" if small or max_distance > _MULTIHASH_MAX_D else "hash"
    if method == "flat":
        index = faiss.IndexBinaryFlat(BITS)
    elif method == "hash" and max_distance == 0:
        index = faiss.IndexBinaryHash(BITS, BITS)  # buckets by the whole code: exact-match lookups
        index.nflip = 0
    elif method == "hash":
        index = faiss.IndexBinaryMultiHash(BITS, 4, BITS // 4)
        index.nflip = max_distance // 4
    else:
        raise ValueError(f"method must be auto, flat or hash, got {method!r}")
    index.add(np.ascontiguousarray(reference, dtype=np.uint8))
    return index


def find_duplicates(reference: np.ndarray, target: np.ndarray, max_distance: int = 0,
                    method: str = "auto") -> list[tuple[int, int, int]]:
    """(target index, reference index, Hamming distance) of every pair within ``max_distance`` bits,
    sorted by target, distance, reference. ``reference`` uint8 [N, 8], ``target`` uint8 [M, 8]."""
    if isinstance(max_distance, bool) or not isinstance(max_distance, (int, np.integer)) \
            or not 0 <= max_distance <= BITS:
        raise NclipError(f"--max-distance must be an integer in [0, {BITS}], got {max_distance!r}")
    if len(reference) == 0 or len(target) == 0:
        return []
    index = build_index(reference, int(max_distance), method, queries=len(target))
    lims, dist, ref = index.range_search(np.ascontiguousarray(target, dtype=np.uint8), int(max_distance) + 1)
    tgt = np.repeat(np.arange(len(target)), np.diff(lims).astype(np.int64))
    order = np.lexsort((ref, dist, tgt))
    return [(int(tgt[k]), int(ref[k]), int(dist[k])) for k in order]


# ---------------------------------------------------------------------------------------------
# the exclusion list for training
# ---------------------------------------------------------------------------------------------


def load_exclusions(path: str | Path) -> set[str]:
    """Identifiers of target images to leave out of training.

    Two formats: the ``duplicates.json`` of ``nclip data dedup`` (a list of {"target",
    "reference", "distance"}: the "target" identifiers are taken), or a text file with one
    identifier per line (blank lines and ``#`` comments skipped). Identifiers are what dedup
    writes: image paths for folders and CSV files, sample keys for shards, ``source:split:index``
    for built-in data.
    """
    path, text = read_text(path, "exclusion list")
    if path.suffix.lower() != ".json":
        return {s for line in text.splitlines() if (s := line.strip()) and not s.startswith("#")}
    rows = parse_json(path, text)
    if not isinstance(rows, list):
        raise NclipError(f"{path}: expected a JSON list (duplicates.json of nclip data dedup)")
    out = set()
    for k, row in enumerate(rows):
        key = row.get("target") if isinstance(row, dict) else row
        if not isinstance(key, str) or not key:
            raise NclipError(f"{path}: entry {k} has no 'target' identifier")
        out.add(key)
    return out
