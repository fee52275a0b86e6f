"""COCO / Flickr30k image-text retrieval from a Karpathy-split JSON and an image folder
(``--dataset karpathy:FILE.json:IMAGES_DIR[:SPLIT]``), read offline.

The file is Karpathy & Fei-Fei's ``dataset_coco.json`` / ``dataset_flickr30k.json``: ``{"dataset":
"coco", "images": [{"filepath": "val2014", "filename": "...jpg", "split": "test", "sentences":
[{"raw": "A man ..."}, ...]}, ...]}``. An image is ``IMAGES_DIR/filepath/filename`` (COCO), or
``IMAGES_DIR/filename`` (Flickr30k, which has no ``filepath``; also COCO with every image in one
folder). ``SPLIT`` defaults to ``test`` (COCO 5k, Flickr30k 1k images); the others are ``val``,
``train`` and ``restval``. Each image keeps its first :data:`CAPTIONS_PER_IMAGE` captions, the
5-captions-per-image protocol of the papers' retrieval tables (COCO has a few images with 6 or 7).

A missing image, an entry without captions and an unknown split are one-line errors naming the
file and the entry.
"""

from __future__ import annotations

from pathlib import Path

from nclip.data.folders import FileSamples, fingerprint
from nclip.errors import NclipError
from nclip.jsonio import parse_json, read_text

CAPTIONS_PER_IMAGE = 5
DEFAULT_SPLIT = "test"


def parse_arg(arg: str) -> tuple[Path, Path, str]:
    """``FILE.json:IMAGES_DIR[:SPLIT]`` -> (file, image folder, split)."""
    parts = arg.split(":")
    if len(parts) not in (2, 3) or not all(p.strip() for p in parts):
        raise NclipError(f"karpathy:{arg}: expected karpathy:FILE.json:IMAGES_DIR[:SPLIT]")
    split = parts[2].strip() if len(parts) == 3 else DEFAULT_SPLIT
    return Path(parts[0].strip()).expanduser(), Path(parts[1].strip()).expanduser(), split


def _entries(path: Path) -> tuple[str | None, list]:
    path, text = read_text(path, "Karpathy split file")
    doc = parse_json(path, text)
    if not isinstance(doc, dict) or not isinstance(doc.get("images"), list):
        raise NclipError(f"{path}: expected a Karpathy split file: an object with an 'images' list")
    name = doc.get("dataset") if isinstance(doc.get("dataset"), str) else None
    return name, doc["images"]


def _image_path(images: Path, entry: dict, where: str) -> Path:
    filename = entry.get("filename")
    if not isinstance(filename, str) or not filename.strip():
        raise NclipError(f"{where}: no 'filename'")
    sub = entry.get("filepath") if isinstance(entry.get("filepath"), str) else ""
    candidates = [images / sub / filename, images / filename] if sub else [images / filename]
    found = next((p for p in candidates if p.is_file()), None)
    if found is None:
        raise NclipError(f"{where}: image not found: {candidates[0]}")
    return found


def _sentences(entry: dict, where: str) -> tuple[str, ...]:
    raw = entry.get("sentences")
    texts = [s.get("raw") for s in raw if isinstance(s, dict)] if isinstance(raw, list) else []
    texts = [t.strip() for t in texts if isinstance(t, str) and t.strip()]
    if not texts:
        raise NclipError(f"{where}: no captions ('sentences' with 'raw' texts)")
    return tuple(texts[:CAPTIONS_PER_IMAGE])


def karpathy(arg: str):
    """The retrieval :class:`~nclip.eval.evaldata.EvalData` of ``karpathy:FILE.json:IMAGES_DIR[:SPLIT]``."""
    from nclip.eval.evaldata import EvalData

    path, images, split = parse_arg(arg)
    if not images.is_dir():
        raise NclipError(f"Karpathy image folder not found: {images}")
    name, entries = _entries(path)
    chosen = [(i, e) for i, e in enumerate(entries) if isinstance(e, dict) and e.get("split") == split]
    if not chosen:
        found = sorted({e.get("split") for e in entries if isinstance(e, dict) and isinstance(e.get("split"), str)})
        raise NclipError(f"{path}: no image in split {split!r} (splits here: {', '.join(found) or 'none'})")
    paths, caps = [], []
    for i, entry in chosen:
        ident = entry.get("cocoid", entry.get("imgid"))
        where = f"{path} images[{i}]" + (f" (id {ident})" if ident is not None else "")
        paths.append(_image_path(images, entry, where))
        caps.append(_sentences(entry, where))
    if len(paths) < 2:
        raise NclipError(f"{path}: retrieval needs at least 2 images in split {split!r}, found {len(paths)}")
    stem = (name or path.stem.removeprefix("dataset_")).lower()
    clean = "".join(ch if ch.isalnum() or ch in "_." else "_" for ch in stem).strip("_") or "karpathy"
    return EvalData(name=clean,
                    identity={"kind": "karpathy", "file": str(path.resolve()), "images": str(images.resolve()),
                              "split": split, "captions_per_image": CAPTIONS_PER_IMAGE,
                              "files": fingerprint([path, *paths])},
                    splits={"test": FileSamples(paths, caps, [{} for _ in paths])}, retrieval=True)
