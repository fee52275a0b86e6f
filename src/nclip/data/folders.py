"""Class-folder trees and image files: the one reader behind ``data.source: folder`` (training) and
``nclip eval --dataset folder:DIR`` / ``realms:DIR`` (:mod:`nclip.eval.datasets`).

A tree is ``DIR/<class>/<image>`` or ``DIR/train/<class>/...`` with ``DIR/test/<class>/...``;
class ids are the sorted class-folder names, class names the folder names with ``_`` and ``-`` as
spaces. Listings are sorted, so the dataset order is deterministic. Problems (a missing folder, a
class without images, an unreadable image) raise one :class:`~nclip.errors.NclipError` naming it,
except an unreadable image in training, which is skipped like a bad CSV row
(:meth:`FileSamples.read`, :mod:`nclip.data.bad_samples`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from nclip.data.types import LabelKind, Sample
from nclip.defaults import USER_LABEL
from nclip.errors import NclipError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
# CLIP-style prompts for class names that come from the user's data (folder names, a CSV label column)
FOLDER_TEMPLATES = ("a photo of a {}.", "a picture of a {}.", "an image of a {}.", "a {}.")


def image_or_reason(path: Path, keep_mode: bool = False):
    """uint8 [H, W, 3] RGB (with ``keep_mode``, the decoded PIL image where its mode is another), or why
    the file cannot be read: ``image not found`` or ``cannot read image: <the decoder's first line>``."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            return decoded_pixels(im, keep_mode)
    except FileNotFoundError:
        return "image not found"
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError) as e:
        return f"cannot read image: {str(e).splitlines()[0] if str(e) else type(e).__name__}"


def load_image(path: Path, where: str = "", keep_mode: bool = False):
    """uint8 [H, W, 3] RGB, or an NclipError naming the file (and ``where`` it was listed).
    ``keep_mode``: an image whose mode is not RGB comes as the decoded PIL image, for evaluation to
    convert where the model's convention does (:func:`nclip.data.transforms.eval_resize`)."""
    out = image_or_reason(path, keep_mode)
    if not isinstance(out, str):
        return out
    what, _, detail = out.partition(": ")
    raise NclipError(f"{where}{what}: {path}" if not detail else f"{where}{what} {path}: {detail}")


def decoded_pixels(image, keep_mode: bool = False):
    """An open PIL image as uint8 [H, W, 3] RGB; with ``keep_mode``, one whose mode is not RGB as the
    loaded PIL image, so that evaluation converts it after its resize and crop as torchvision's
    pipelines do (a P image resizes by nearest, an RGBA one with its alpha)."""
    if keep_mode and image.mode != "RGB":
        image.load()
        return image.copy()
    return np.asarray(image.convert("RGB"))


class FileSamples(Sequence):
    """Samples whose images are read from disk on access; ``label_kinds`` as every dataset's. Indexing
    gives the evaluation's samples, :meth:`read` the training's (RGB arrays). ``keep_mode``: indexing gives
    an image that is not RGB as the decoded PIL image (:func:`decoded_pixels`), as ``nclip embed`` reads a
    file (open_clip's preprocess on ``Image.open``); evaluation decodes to RGB first, as CLIP_benchmark's
    readers and torchvision's ImageFolder do, so that its numbers are theirs."""

    keep_mode = False

    def __init__(self, paths: list[Path], captions: list[tuple[str, ...]], labels: list[dict[str, int]],
                 where: list[str] | None = None, label_kinds: dict[str, LabelKind] | None = None):
        self.paths, self.captions, self.labels = paths, captions, labels
        self.where = where or [""] * len(paths)
        self.label_kinds = label_kinds or {}

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self._sample(i, load_image(self.paths[i], self.where[i], keep_mode=self.keep_mode))

    def read(self, i: int) -> Sample | str:
        """Sample ``i``, or why its image cannot be read (training skips it: :mod:`nclip.data.bad_samples`)."""
        image = image_or_reason(self.paths[i])
        return image if isinstance(image, str) else self._sample(i, image)

    def where_of(self, i: int) -> str:
        return f"{self.where[i]}{self.paths[i]}"

    def _sample(self, i: int, image: np.ndarray) -> Sample:
        caps = self.captions[i]
        return Sample(image=image, caption=caps[0], captions=caps, labels=dict(self.labels[i]))


def fingerprint(paths: list[Path], extra: str = "") -> str:
    """Hash of the file list with sizes and modification times (a changed file invalidates a cache)."""
    h = hashlib.sha256(extra.encode())
    for p in paths:
        st = p.stat()
        h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def images_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def class_folders(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def class_name(folder_name: str) -> str:
    """The class name of a class folder: ``golden_retriever`` → ``golden retriever``."""
    return folder_name.replace("_", " ").replace("-", " ").strip()


def scan_classes(root: Path) -> dict[str, dict[str, list[Path]]]:
    """{split: {class folder name: [images]}} for ``root/<class>/`` (split "all") or
    ``root/{train,test}/<class>/``."""
    if not root.is_dir():
        raise NclipError(f"dataset folder not found: {root}")
    if (root / "train").is_dir() and (root / "test").is_dir():
        out = {s: {c.name: images_in(c) for c in class_folders(root / s)} for s in ("train", "test")}
    else:
        out = {"all": {c.name: images_in(c) for c in class_folders(root)}}
    for split, classes in out.items():
        where = root if split == "all" else root / split
        if len(classes) < 2:
            raise NclipError(f"{where}: expected one sub-folder per class (at least 2), found {len(classes)}")
        for name, files in classes.items():
            if not files:
                raise NclipError(f"{where / name}: no images ({', '.join(IMAGE_SUFFIXES)})")
    if "train" in out and sorted(out["train"]) != sorted(out["test"]):
        raise NclipError(f"{root}: train/ and test/ must hold the same class folders")
    return out


def folder_train_samples(root: str | Path) -> FileSamples:
    """The training set of ``data.source: folder``: every image of ``root/<class>/`` (or of
    ``root/train/<class>/``, leaving ``test/`` to evaluation), class by class in sorted order, with
    label kind ``label`` (class id: the sorted folder's position) and the class name as caption."""
    root = Path(root).expanduser()
    scan = scan_classes(root)
    classes = scan.get("train", scan.get("all"))
    folders = sorted(classes)
    names = tuple(class_name(f) for f in folders)
    paths, labels = [], []
    for c, folder in enumerate(folders):
        paths += classes[folder]
        labels += [{USER_LABEL: c}] * len(classes[folder])
    return FileSamples(paths, [(names[lab[USER_LABEL]],) for lab in labels], labels,
                       label_kinds={USER_LABEL: LabelKind(names, FOLDER_TEMPLATES)})
