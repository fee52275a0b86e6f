"""The user's segmentation data (``nclip eval --dataset masks:DIR``) for mask probing (xCLIP Sec.
4.2.1, App. D.1 Tab. 12, on Pascal VOC 2012; :mod:`nclip.eval.masks`).

Layouts: Pascal VOC's ``DIR/JPEGImages/<id>.jpg`` with ``DIR/SegmentationClass/<id>.png``, or
``DIR/images/<name>.<ext>`` with ``DIR/masks/<name>.png``. A mask is a single-channel PNG of class
indices the size of its image (VOC's palette PNGs are), 0 = background and 255 = void. The
foreground the attention is compared with is every pixel of a class (not 0, not 255); void pixels
count neither way (the sample's ``ignore`` mask). In the VOC layout with an
``ImageSets/Segmentation/val.txt`` the images are the ones it lists (VOC 2012 val: 1,449), else
every image of the images folder, sorted; each must have its mask. Problems (an image without its
mask, a mask of another size, a mask with colour channels) are one-line errors naming the file.

Zero-shot segmentation (:mod:`nclip.eval.segmentation`) segments into VOC's 20 classes (mask
indices 1-20), named as VOC names them or as GroupViT does (``--voc-classnames groupvit``: "table",
"plant", "monitor"), each the ensemble of ``--templates`` (default: CLIP's 80 ImageNet templates;
``simple``: GroupViT's one, "a photo of a {}.").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nclip.data.folders import IMAGE_SUFFIXES, fingerprint, images_in, load_image
from nclip.data.types import LabelKind, Sample
from nclip.errors import NclipError
from nclip.eval import prompts
from nclip.eval.evaldata import EvalData, dataset_name
from nclip.eval.prompts import IMAGENET80

LAYOUTS = (("JPEGImages", "SegmentationClass"), ("images", "masks"))
# PASCAL VOC 2012's 20 classes, mask indices 1-20 (zero-shot segmentation's class prompts)
VOC_CLASSES = ("aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow", "dining table",
               "dog", "horse", "motorbike", "person", "potted plant", "sheep", "sofa", "train", "tv monitor")
# GroupViT's names of them (its segmentation/datasets/pascal_voc.py): three are shorter
_GROUPVIT_NAMES = {"dining table": "table", "potted plant": "plant", "tv monitor": "monitor"}
VOC_NAMES = {"voc": VOC_CLASSES, "groupvit": tuple(_GROUPVIT_NAMES.get(name, name) for name in VOC_CLASSES)}
VOID = 255  # VOC: object borders and ambiguous pixels
SPLIT_LIST = Path("ImageSets") / "Segmentation" / "val.txt"
_SINGLE_CHANNEL = ("1", "L", "P", "I", "I;16")


@dataclass
class MaskedSample(Sample):
    """A sample whose ``masks`` [K, H, W] are the pixels of each of its K classes (their union the
    foreground), ``mask_classes`` [K] the classes (VOC index − 1: 0 = aeroplane), with the void
    pixels in ``ignore`` [H, W]."""

    ignore: np.ndarray | None = None


class MaskedImages(Sequence):
    """(image, mask) file pairs read on access as :class:`MaskedSample`."""

    def __init__(self, pairs: list[tuple[Path, Path]]):
        self.pairs = pairs
        self.label_kinds: dict = {}

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        image_path, mask_path = self.pairs[i]
        classes = read_mask(mask_path)
        present = [int(c) for c in np.unique(classes) if c not in (0, VOID)]
        masks = np.stack([classes == c for c in present]) if present else np.zeros((0, *classes.shape), bool)
        return MaskedSample(image=load_image(image_path), caption="", captions=("",), masks=masks,
                            mask_classes=np.array(present, dtype=np.int64) - 1, ignore=classes == VOID)


def read_mask(path: Path) -> np.ndarray:
    """The class-index array [H, W] of a single-channel mask PNG (NclipError naming the file)."""
    from PIL import Image, UnidentifiedImageError

    _check_mode(path, _header(path)[1])
    try:
        with Image.open(path) as im:
            return np.asarray(im)
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError) as e:
        raise NclipError(f"cannot read mask {path}: {str(e).splitlines()[0]}") from None


def _header(path: Path) -> tuple[tuple[int, int], str]:
    """((width, height), mode) of an image file, from its header."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            return im.size, im.mode
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError) as e:
        raise NclipError(f"cannot read {path}: {str(e).splitlines()[0]}") from None


def _check_mode(path: Path, mode: str) -> None:
    if mode not in _SINGLE_CHANNEL:
        raise NclipError(f"{path}: a mask must be a single-channel PNG of class indices, got mode {mode}")


def _layout(root: Path) -> tuple[Path, Path]:
    for images, masks in LAYOUTS:
        if (root / images).is_dir() and (root / masks).is_dir():
            return root / images, root / masks
    raise NclipError(f"{root}: expected {' + '.join(f'{a}/' for a in LAYOUTS[0])} (Pascal VOC) "
                     f"or {' + '.join(f'{a}/' for a in LAYOUTS[1])}")


def _images(root: Path, images: Path) -> list[Path]:
    """The images to probe: those of VOC's val list when there is one, else every image, sorted."""
    listing = root / SPLIT_LIST
    if images.name != LAYOUTS[0][0] or not listing.is_file():
        return images_in(images)
    out = []
    for n, line in enumerate(listing.read_text(encoding="utf-8").splitlines(), start=1):
        stem = line.strip()
        if not stem:
            continue
        found = next((images / (stem + s) for s in IMAGE_SUFFIXES if (images / (stem + s)).is_file()), None)
        if found is None:
            raise NclipError(f"{listing}:{n}: no image {stem}.* in {images}")
        out.append(found)
    return out


def mask_folder(root: str | Path, templates: str | None = None, names: str = "voc") -> EvalData:
    """The mask-probing and segmentation test set of ``root`` (see the module docstring); the
    segmentation's templates from ``templates`` (:mod:`nclip.eval.prompts`), its class names VOC's
    own or GroupViT's (``names``: a key of :data:`VOC_NAMES`)."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise NclipError(f"dataset folder not found: {root}")
    images, masks = _layout(root)
    pairs = []
    for image in _images(root, images):
        mask = masks / (image.stem + ".png")
        if not mask.is_file():
            raise NclipError(f"{image}: no mask {mask}")
        ((w, h), mode), ((iw, ih), _) = _header(mask), _header(image)
        _check_mode(mask, mode)
        if (w, h) != (iw, ih):
            raise NclipError(f"{mask}: mask is {w}x{h} pixels but its image {image.name} is {iw}x{ih}")
        pairs.append((image, mask))
    if not pairs:
        raise NclipError(f"{images}: no images ({', '.join(IMAGE_SUFFIXES)})")
    return EvalData(name=dataset_name(root),
                    identity={"kind": "masks", "root": str(root.resolve()),
                              "files": fingerprint([p for pair in pairs for p in pair])},
                    splits={"test": MaskedImages(pairs)}, masks=True,
                    segment_space=LabelKind(VOC_NAMES[names], prompts.templates(templates, IMAGENET80)))
