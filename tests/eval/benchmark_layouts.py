"""Tiny copies of the layouts researchers keep benchmarks in, written by the tests: CLIP_benchmark's
WebDataset copy (``wds:``), an ImageFolder split (``imagefolder:``) and a Karpathy-split JSON with
its images (``karpathy:``)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
from PIL import Image

COLOURS = ("red", "green", "blue")


def image(c: int, i: int, size: int = 12) -> np.ndarray:
    """A small image dominated by colour channel ``c`` (noise seeded by ``i``)."""
    rng = np.random.default_rng(100 * c + i)
    img = rng.integers(0, 50, (size, size, 3), dtype=np.uint8)
    img[..., c % 3] = 200
    return img


def _bytes(img: np.ndarray, fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format={"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}[fmt])
    return buf.getvalue()


def write_wds(root: Path, per_class: int = 3, shards: int = 2, split: str = "test", retrieval: bool = False,
              fmt: str = "webp") -> Path:
    """CLIP_benchmark's layout, written with the ``webdataset`` library as its exporter does:
    keys ``s%07d``, the image under ``fmt``, the class index under ``cls`` (or captions, one per
    line, under ``txt`` with ``dataset_type.txt`` = retrieval), ``SPLIT/0.tar ...`` + ``nshards.txt``."""
    import webdataset

    root.mkdir(parents=True, exist_ok=True)
    if retrieval:
        (root / "dataset_type.txt").write_text("retrieval\n")
    else:
        (root / "classnames.txt").write_text("\n".join(COLOURS) + "\n")
        (root / "zeroshot_classification_templates.txt").write_text("a photo of a {c}.\na {c} picture.\n")
    rows = [(c, i) for i in range(per_class) for c in range(len(COLOURS))]
    per_shard = -(-len(rows) // shards)
    (root / split).mkdir(exist_ok=True)
    for s in range(shards):
        with webdataset.TarWriter(str(root / split / f"{s}.tar")) as sink:
            for n, (c, i) in enumerate(rows[s * per_shard:(s + 1) * per_shard], start=s * per_shard):
                sample = {"__key__": f"s{n:07d}", fmt: _bytes(image(c, i), fmt)}
                if retrieval:
                    sample["txt"] = f"a {COLOURS[c]} square\na mostly {COLOURS[c]} picture number {i}"
                else:
                    sample["cls"] = c
                sink.write(sample)
    (root / split / "nshards.txt").write_text(f"{shards}\n")
    return root


def write_imagefolder(root: Path, per_class: int = 3, splits=("val",)) -> Path:
    """``root/<split>/<wnid>/<i>.png`` with ImageNet-like folder names, and ``root/class_index.json``
    in the ``imagenet_class_index.json`` layout (index -> [folder, name])."""
    folders = [f"n0{c}000{c}" for c in range(len(COLOURS))]
    for split in splits:
        for c, folder in enumerate(folders):
            (root / split / folder).mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                Image.fromarray(image(c, i + (50 if split == "train" else 0))).save(root / split / folder / f"{i}.png")
    (root / "class_index.json").write_text(json.dumps({str(c): [f, COLOURS[c]] for c, f in enumerate(folders)}))
    return root


def write_karpathy(root: Path, per_split: int = 4, captions: int = 6) -> tuple[Path, Path]:
    """``root/dataset_coco.json`` (Karpathy's layout: filepath/filename, split, sentences/raw) and
    ``root/images/<filepath>/<filename>``; ``captions`` captions per image."""
    entries = []
    for n, split in enumerate(["train"] * per_split + ["test"] * per_split + ["val"] * 2):
        c = n % len(COLOURS)
        folder = "val2014" if split != "train" else "train2014"
        name = f"COCO_{folder}_{n:012d}.jpg"
        path = root / "images" / folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image(c, n)).save(path)
        entries.append({"filepath": folder, "filename": name, "split": split, "cocoid": n, "imgid": n,
                        "sentences": [{"raw": f"a {COLOURS[c]} square, caption {k} of image {n}", "tokens": []}
                                      for k in range(captions)]})
    path = root / "dataset_coco.json"
    path.write_text(json.dumps({"dataset": "coco", "images": entries}))
    return path, root / "images"
