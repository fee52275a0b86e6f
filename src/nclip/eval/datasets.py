"""Evaluation datasets: the built-in ones and generic adapters for the user's own data.

Every dataset becomes an :class:`EvalData`: named splits of ``Sample`` sequences plus a
description of which protocols apply to it. Spec strings (``--dataset``) select them; their grammar
and the table of kinds are :mod:`nclip.dataset_specs`, and each kind's data is laid out as follows:

=====================  =========================================================================
``synthetic``          built-in synthetic scenes: every label kind (shape, colour, count, realm,
                       size), shape/colour multi-labels, object masks, realms (shape per realm)
``digits``             scikit-learn's 8x8 digits (label kind ``digit``)
``folder:DIR``         classification: ``DIR/<class>/<image>``, or ``DIR/train/<class>/...`` and
                       ``DIR/test/<class>/...``; without train/test folders a seeded stratified
                       70/30 split is made. Class names are the folder names (``_`` -> space).
``realms:DIR``         realm-wise probing (OmniBenchmark Sec. 3.6): ``DIR/<realm>/<class>/<image>``
                       (or ``DIR/<realm>/{train,test}/<class>/...``), one dataset per realm
``captions:FILE``      retrieval: a CSV (header ``image,caption``; more captions as further
                       ``caption*`` columns or repeated rows of the same image; the training
                       CSV's columns, e.g. ``filepath,title``, its cells split by the run's
                       ``data.caption_separator``, or ``--image-key/--caption-key``)
                       or a JSONL file
                       (``{"image": ..., "caption": ...}`` or ``{"image": ..., "captions": [...]}``);
                       image paths are relative to the file's folder
``hardneg:FILE``       a caption against its hard negatives (SugarCrepe / ARO style): rows of an
                       image, its caption and negatives, :mod:`nclip.eval.hardneg`
``sts:FILE``           text similarity: CSV/TSV with header ``sentence1,sentence2,score``
``multilabel:FILE``    zero-shot multi-label: a CSV (header row; columns image path, ``;``-separated
                       labels), :mod:`nclip.eval.multilabel_file`
``masks:DIR``          mask probing: ``DIR/JPEGImages`` + ``DIR/SegmentationClass`` (VOC) or
                       ``DIR/images`` + ``DIR/masks``, :mod:`nclip.eval.mask_folder`
``wds:DIR[:SPLIT]``     CLIP_benchmark's WebDataset copy (``classnames.txt``, templates, ``SPLIT/``
                       tar shards with ``nshards.txt``; split ``test`` by default),
                       :mod:`nclip.eval.wds_benchmark`
``imagefolder:DIR``    one ImageFolder split evaluated whole (``val/<class>/...``; a sibling
                       ``train/`` for probes), :mod:`nclip.eval.imagefolder`
``karpathy:F:IMAGES``  COCO / Flickr30k retrieval from a Karpathy-split JSON and an image folder
                       (``karpathy:FILE.json:IMAGES_DIR[:SPLIT]``, ``test`` by default),
                       :mod:`nclip.eval.karpathy`
=====================  =========================================================================

``--classnames`` and ``--templates`` (:mod:`nclip.eval.prompts`) replace the class names and
prompts of ``folder:``, ``imagefolder:``, ``wds:`` (and ``multilabel:``) data, ``--templates`` those of ``realms:`` too.

Problems with user data (a missing file, a malformed row, an unreadable image) raise one
:class:`~nclip.errors.NclipError` whose message names the file and the row.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nclip.data.captions import split_text
from nclip.data.folders import FOLDER_TEMPLATES, FileSamples, class_folders, class_name, fingerprint, scan_classes
from nclip.data.types import LabelKind
from nclip.dataset_specs import DATASET_KINDS, parse_spec
from nclip.errors import NclipError
from nclip.eval.evaldata import EvalData
from nclip.eval.evaldata import dataset_name as _dataset_name
from nclip.jsonio import jsonl_objects

USER_SPLIT_TEST_FRACTION = 0.3


# ---------------------------------------------------------------------------------------------
# built-in data
# ---------------------------------------------------------------------------------------------


def synthetic(image_size: int, max_objects: int, seed: int, test_samples: int, train_samples: int) -> EvalData:
    from nclip.data.synthetic import SyntheticScenes

    def make(split, n):  # faithful captions only: loose ones are a training-data property
        return SyntheticScenes(split=split, length=n, seed=seed, image_size=image_size,
                               max_objects=max_objects, loose_caption_prob=0.0)

    test = make("test", test_samples)
    return EvalData(
        name="synthetic",
        identity={"kind": "synthetic", "seed": seed, "image_size": image_size, "max_objects": max_objects,
                  "lengths": {"test": test_samples, "train": train_samples}},
        splits={"test": test, "train": make("train", train_samples)},
        label_kinds=dict(test.label_kinds),
        retrieval=True,
        multilabel_kinds=("shape", "colour"),
        masks=True,
        segment_space=test.label_kinds["shape"],
        realm=("realm", "shape"),
    )


def synthetic_sts(n: int, seed: int) -> EvalData:
    from nclip.data.synthetic import sts_pairs

    return EvalData(name="synthetic", identity={"kind": "synthetic-sts", "n": n, "seed": seed},
                    sts=sts_pairs(n, seed))


def digits(image_size: int, seed: int) -> EvalData:
    from nclip.data.digits import DigitsPairs

    # the probe's own validation split is carved from "train", so train + val are one pool here
    test = DigitsPairs("test", seed=seed, image_size=image_size, val_fraction=0.0)
    train = DigitsPairs("train", seed=seed, image_size=image_size, val_fraction=0.0)
    return EvalData(
        name="digits",
        identity={"kind": "digits", "seed": seed, "image_size": image_size},
        splits={"test": test, "train": train},
        label_kinds=dict(test.label_kinds),
        retrieval=True,
    )


# ---------------------------------------------------------------------------------------------
# user data (folder trees and image files: nclip.data.folders, shared with training)
# ---------------------------------------------------------------------------------------------


def _split_indices(labels: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    from nclip.eval.metrics import stratified_split

    tr, te = stratified_split(labels, USER_SPLIT_TEST_FRACTION, seed)
    return tr.numpy(), te.numpy()


def _folder_splits(root: Path, seed: int, label: str, extra_labels: dict[str, int] | None = None,
                   class_offset: int = 0):
    """(names, {split: (paths, labels)}) of a class-folder tree; labels offset by ``class_offset``."""
    scan = scan_classes(root)
    names = sorted(next(iter(scan.values())))
    splits = {}
    for split, classes in scan.items():
        paths, ys = [], []
        for c, name in enumerate(names):
            paths += classes[name]
            ys += [c + class_offset] * len(classes[name])
        splits[split] = (paths, np.array(ys))
    if "all" in splits:
        # the seeded 70/30 split puts every class in both halves: one image cannot be in both
        few = next((name for name in names if len(scan["all"][name]) < 2), None)
        if few is not None:
            share = USER_SPLIT_TEST_FRACTION
            raise NclipError(f"{root / few}: {len(scan['all'][few])} image; the seeded {1 - share:.0%}/{share:.0%} "
                             f"split needs at least 2 per class (or give "
                             f"{root}/train/ and {root}/test/ folders)")
        paths, ys = splits.pop("all")
        tr, te = _split_indices(ys, seed)
        splits = {"train": ([paths[i] for i in tr], ys[tr]), "test": ([paths[i] for i in te], ys[te])}
    extra = extra_labels or {}
    out = {}
    for split, (paths, ys) in splits.items():
        out[split] = (paths, [{label: int(y), **extra} for y in ys])
    return names, out


def image_folder(root: str | Path, seed: int = 0, classnames: str | None = None,
                 templates: str | None = None) -> EvalData:
    """``root/<class>/...``; class names and templates from the files ``classnames`` / ``templates``
    (:mod:`nclip.eval.prompts`), by default the folder names and :data:`FOLDER_TEMPLATES`."""
    from nclip.eval import prompts

    root = Path(root).expanduser()
    names, splits = _folder_splits(root, seed, "class")
    space = LabelKind(prompts.class_names(classnames, names, [class_name(n) for n in names], "class folder"),
                       prompts.templates(templates, FOLDER_TEMPLATES))
    data = EvalData(name=_dataset_name(root), identity={}, label_kinds={"class": space})
    return _with_splits(data, splits, space, "folder", root, seed, names)


def realm_folders(root: str | Path, seed: int = 0, templates: str | None = None) -> EvalData:
    """``root/<realm>/<class>/...``: label kinds ``realm`` and ``class`` (names ``realm/class``)."""
    from nclip.eval import prompts

    root = Path(root).expanduser()
    if not root.is_dir():
        raise NclipError(f"dataset folder not found: {root}")
    realms = class_folders(root)
    if not realms:
        raise NclipError(f"{root}: expected one sub-folder per realm, each with one sub-folder per class")
    class_names: list[str] = []
    merged: dict[str, tuple[list, list]] = {"train": ([], []), "test": ([], [])}
    for r, realm in enumerate(realms):
        names, splits = _folder_splits(realm, seed, "class", {"realm": r}, class_offset=len(class_names))
        class_names += [f"{class_name(n)}" for n in names]
        for split, (paths, labels) in splits.items():
            merged[split][0].extend(paths)
            merged[split][1].extend(labels)
    chosen = prompts.templates(templates, FOLDER_TEMPLATES)
    realm_space = LabelKind(tuple(class_name(r.name) for r in realms), chosen)
    class_space = LabelKind(tuple(class_names), chosen)
    data = EvalData(name=_dataset_name(root), identity={},
                    label_kinds={"realm": realm_space, "class": class_space}, realm=("realm", "class"))
    return _with_splits(data, merged, class_space, "realms", root, seed, class_names)


def _with_splits(data: EvalData, splits: dict[str, tuple[list, list]], classes: LabelKind, kind: str,
                 root: Path, seed: int, names: list[str]) -> EvalData:
    """``data`` with its file splits (each image captioned by its class's first prompt) and an
    identity that fingerprints the files and class names, so the feature cache sees any change."""
    files = []
    for split, (paths, labels) in splits.items():
        caps = [(classes.prompts(lab["class"])[0],) for lab in labels]
        data.splits[split] = FileSamples(paths, caps, labels)
        files += paths
    data.identity = {"kind": kind, "root": str(root.resolve()), "seed": seed,
                     "files": fingerprint(files, json.dumps(names))}
    return data


_IMAGE_KEYS = ("image", "image_path", "filepath", "file", "path")


def _check_image(base: Path, value, where: str) -> Path:
    if not isinstance(value, str) or not value.strip():
        raise NclipError(f"{where}: missing image path")
    path = Path(value.strip()).expanduser()
    path = path if path.is_absolute() else base / path
    if not path.is_file():
        raise NclipError(f"{where}: image not found: {path}")
    return path


def caption_file(path: str | Path, image_key: str | None = None, caption_key: str | None = None,
                 run_keys: tuple[str, ...] | None = None) -> EvalData:
    """Image-caption pairs for retrieval from a CSV or JSONL file (see the module docstring).

    A CSV's columns: ``image_key``/``caption_key`` when given (``nclip eval --image-key/--caption-key``:
    they must be in the header); else the columns the run was trained on, ``run_keys`` (its
    ``data.csv_image_key``, ``data.csv_caption_key`` and ``data.caption_separator``:
    ``DataConfig.caption_keys``), when the header has them, so the training CSV (``filepath,title``)
    evaluates as it is, every caption of an image its ground truth; else the names of the module
    docstring. A JSONL row's fields are found the same way."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise NclipError(f"captions file not found: {path}")
    base = path.parent
    columns: list[str] = []  # a CSV's columns read (part of the identity: another column, other features)
    split_by: set[str] = set()  # the run's caption separator, where it split a caption text (identity too)
    order: list[Path] = []
    caps: dict[Path, list[str]] = {}
    where_of: dict[Path, str] = {}

    def add(img: Path, texts: list[str], where: str):
        if img not in caps:
            order.append(img)
            caps[img] = []
            where_of[img] = where
        caps[img].extend(texts)

    run_image, run_caption, separator = (tuple(run_keys) + (None,) * 3)[:3] if run_keys else (None, None, None)
    if path.suffix.lower() in (".jsonl", ".ndjson"):
        with path.open(encoding="utf-8") as fh:
            for n, row in jsonl_objects(fh, path):
                where = f"{path} line {n}"
                key = image_key or next((k for k in (run_image, *_IMAGE_KEYS) if k in row), None)
                img = _check_image(base, row.get(key) if key else None, where)
                field = caption_key or next((k for k in (run_caption, "captions", "caption") if k in row), None)
                texts = row.get(field) if field else None
                split = separator if field == run_caption and not caption_key else None
                split_by.update([split] if split else [])
                texts = list(split_text(texts, split)) if isinstance(texts, str) else texts
                if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t.strip() for t in texts):
                    raise NclipError(f"{where}: {field or 'caption'!r} must be a non-empty string "
                                     "(or a list of them)")
                add(img, [t.strip() for t in texts], where)
    elif path.suffix.lower() in (".csv", ".tsv"):
        with path.open(encoding="utf-8", newline="") as fh:
            reader, header = _csv_reader(fh, path)
            img_key, cap_keys = _caption_columns(path, header, image_key, caption_key, run_keys)
            # the run's own caption column holds several captions split by its separator
            split = {k: separator if run_caption and k == run_caption.strip().lower() and not caption_key else None
                     for k in cap_keys}
            split_by.update(v for v in split.values() if v)
            columns = [str(img_key), *cap_keys]
            if img_key is None or not cap_keys:
                raise NclipError(f"{path} line 1: the header needs an image column ({'/'.join(_IMAGE_KEYS)}) "
                                 f"and at least one caption column, got {','.join(header) or 'nothing'}")
            for where, row in _csv_rows(reader, path):
                img = _check_image(base, row.get(img_key), where)
                texts = [t for k in cap_keys if row.get(k) for t in split_text(row[k], split[k])]
                if not texts:
                    raise NclipError(f"{where}: no caption")
                add(img, texts, where)
    else:
        raise NclipError(f"{path}: captions must be a .csv, .tsv or .jsonl file")
    if len(order) < 2:
        raise NclipError(f"{path}: retrieval needs at least 2 images, found {len(order)}")
    samples = FileSamples(order, [tuple(dict.fromkeys(caps[p])) for p in order], [{} for _ in order],
                          [f"{where_of[p]}: " for p in order])
    return EvalData(name=_dataset_name(path),
                    identity={"kind": "captions", "file": str(path.resolve()),
                              **({"columns": columns} if columns else {}),
                              **({"caption_separator": min(split_by)} if split_by else {}),
                              "files": fingerprint([path, *order])},
                    splits={"test": samples}, retrieval=True)


def _caption_columns(path: Path, header: list[str], image_key: str | None, caption_key: str | None,
                     run_keys: tuple[str, ...] | None) -> tuple[str | None, list[str]]:
    """(image column, caption columns) of a captions CSV; see :func:`caption_file`."""
    for option, key in (("--image-key", image_key), ("--caption-key", caption_key)):
        if key is not None and key.strip().lower() not in header:
            raise NclipError(f"{path} line 1: {option} {key!r} is not a column of the header "
                             f"{','.join(header) or '(empty)'}")
    run_image, run_caption = (k.strip().lower() for k in run_keys[:2]) if run_keys else (None, None)
    img_key = (image_key.strip().lower() if image_key else None) \
        or (run_image if run_image in header else None) or next((k for k in _IMAGE_KEYS if k in header), None)
    if caption_key:
        return img_key, [caption_key.strip().lower()]
    if run_caption in header and run_caption != img_key:
        return img_key, [run_caption]
    return img_key, [h for h in header if h.startswith("caption")]


def _csv_reader(fh, path: Path) -> tuple[csv.DictReader, list[str]]:
    """A DictReader of a .csv (comma) or .tsv (tab) file whose column names are trimmed and lower
    case, and that header."""
    reader = csv.DictReader(fh, delimiter="\t" if path.suffix.lower() == ".tsv" else ",")
    header = [h.strip().lower() for h in (reader.fieldnames or [])]
    reader.fieldnames = header
    return reader, header


def _csv_rows(reader: csv.DictReader, path: Path) -> Iterator[tuple[str, dict]]:
    """(where, row) of each data row, ``where`` = "PATH line N"; a row longer than the header is an error."""
    for row in reader:
        where = f"{path} line {reader.line_num}"
        if None in row:
            raise NclipError(f"{where}: more fields than the header has")
        yield where, row


_STS_A, _STS_B, _STS_SCORE = ("sentence1", "text_a", "sentence_a"), ("sentence2", "text_b", "sentence_b"), \
    ("score", "similarity", "label")


def sts_file(path: str | Path) -> EvalData:
    """Graded sentence pairs: CSV/TSV with a ``sentence1,sentence2,score`` header."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise NclipError(f"STS file not found: {path}")
    pairs = []
    with path.open(encoding="utf-8", newline="") as fh:
        reader, header = _csv_reader(fh, path)
        cols = [next((k for k in names if k in header), None) for names in (_STS_A, _STS_B, _STS_SCORE)]
        if None in cols:
            raise NclipError(f"{path} line 1: the header must name sentence1, sentence2 and score columns, "
                             f"got {','.join(header) or 'nothing'}")
        for where, row in _csv_rows(reader, path):
            a, b, s = (row.get(c) for c in cols)
            if not a or not a.strip() or not b or not b.strip():
                raise NclipError(f"{where}: empty sentence")
            try:
                score = float(s)
            except (TypeError, ValueError):
                raise NclipError(f"{where}: score {s!r} is not a number") from None
            if not np.isfinite(score):
                raise NclipError(f"{where}: score {s!r} is not finite")
            pairs.append((a.strip(), b.strip(), score))
    if len(pairs) < 2:
        raise NclipError(f"{path}: STS needs at least 2 sentence pairs, found {len(pairs)}")
    return EvalData(name=_dataset_name(path),
                    identity={"kind": "sts", "file": str(path.resolve()), "files": fingerprint([path])},
                    sts=pairs)


# ---------------------------------------------------------------------------------------------
# spec strings: a builder per kind of the grammar's table
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _BuildArgs:
    """What a builder may read besides its spec's argument (see :func:`build`)."""

    image_size: int
    max_objects: int
    seed: int
    test_samples: int
    train_samples: int
    sts_pairs: int
    classnames: str | None
    templates: str | None
    voc_classnames: str
    image_key: str | None
    caption_key: str | None
    run_keys: tuple[str, ...] | None


def _synthetic(arg: None, a: _BuildArgs) -> list[EvalData]:
    out = [synthetic(a.image_size, a.max_objects, a.seed, a.test_samples, a.train_samples)]
    return out + [synthetic_sts(a.sts_pairs, a.seed)] if a.sts_pairs else out


def _multilabel(arg: str, a: _BuildArgs) -> list[EvalData]:
    from nclip.eval.multilabel_file import multilabel_file

    return [multilabel_file(arg, a.classnames, a.templates)]


def _masks(arg: str, a: _BuildArgs) -> list[EvalData]:
    from nclip.eval.mask_folder import mask_folder

    return [mask_folder(arg, a.templates, a.voc_classnames)]


def _wds(arg: str, a: _BuildArgs) -> list[EvalData]:
    from nclip.eval.wds_benchmark import wds_benchmark

    return [wds_benchmark(arg, a.classnames, a.templates)]


def _imagefolder(arg: str, a: _BuildArgs) -> list[EvalData]:
    from nclip.eval.imagefolder import image_split

    return [image_split(arg, a.classnames, a.templates)]


def _hardneg(arg: str, a: _BuildArgs) -> list[EvalData]:
    from nclip.eval.hardneg import hardneg_file

    return [hardneg_file(arg, a.run_keys)]


def _karpathy(arg: str, a: _BuildArgs) -> list[EvalData]:
    from nclip.eval.karpathy import karpathy

    return [karpathy(arg)]


# the builder of each kind of nclip.dataset_specs.DATASET_KINDS (the grammar's table, checked below)
_BUILDERS: dict[str, Callable[[str | None, _BuildArgs], list[EvalData]]] = {
    "synthetic": _synthetic,
    "digits": lambda arg, a: [digits(a.image_size, a.seed)],
    "folder": lambda arg, a: [image_folder(arg, a.seed, a.classnames, a.templates)],
    "realms": lambda arg, a: [realm_folders(arg, a.seed, a.templates)],
    "captions": lambda arg, a: [caption_file(arg, a.image_key, a.caption_key, a.run_keys)],
    "hardneg": _hardneg,
    "sts": lambda arg, a: [sts_file(arg)],
    "multilabel": _multilabel,
    "masks": _masks,
    "wds": _wds,
    "imagefolder": _imagefolder,
    "karpathy": _karpathy,
}
if _BUILDERS.keys() != DATASET_KINDS.keys():  # a kind added to the grammar needs its builder here
    raise ImportError(f"nclip.eval.datasets builds {sorted(_BUILDERS)}, the spec grammar has {sorted(DATASET_KINDS)}")


def build(spec: str, *, image_size: int, max_objects: int, seed: int, test_samples: int,
          train_samples: int, sts_pairs: int, classnames: str | None = None,
          templates: str | None = None, image_key: str | None = None, caption_key: str | None = None,
          run_keys: tuple[str, ...] | None = None, voc_classnames: str = "voc") -> list[EvalData]:
    """The EvalData(s) for one spec string (``synthetic`` yields the scenes and their STS pairs);
    ``classnames`` / ``templates``: the user's prompts (:mod:`nclip.eval.prompts`); the keys: a
    captions CSV's columns (:func:`caption_file`); ``voc_classnames``: whose names of VOC's classes
    ``masks:`` data segments into (:data:`nclip.eval.mask_folder.VOC_NAMES`)."""
    kind, arg = parse_spec(spec)
    return _BUILDERS[kind](arg, _BuildArgs(image_size, max_objects, seed, test_samples, train_samples, sts_pairs,
                                           classnames, templates, voc_classnames, image_key, caption_key, run_keys))
