"""One ImageFolder split evaluated whole (``--dataset imagefolder:DIR``), e.g. ImageNet's
``val/<class>/<image>``, read offline.

``folder:DIR`` reads a dataset *tree* (``DIR/<class>`` split 70/30, or ``DIR/train`` + ``DIR/test``);
a benchmark's validation folder is instead a *split*: every image in it is a test image, and its
class indices are torchvision ImageFolder's (the sorted folder names' positions), the indices
that class-index files refer to. So ``imagefolder:DIR`` is a spec of its own rather than a
``folder:`` option: ``DIR`` is the split, all of it is the test split, and when ``DIR`` is not
itself ``train`` and the sibling ``DIR/../train/`` holds the same class folders, that folder
trains the linear and k-NN probes (listed only when a probe runs).

Class names are the folder names (``_`` -> space) unless ``--classnames`` gives a file
(:func:`nclip.eval.prompts.class_names`): one name per line in sorted folder order, a JSON map
folder -> name, or a class-index file: a JSON map index -> name or index -> [folder, name] (the
``imagenet_class_index.json`` layout, whose folder must be the index's sorted folder). An index
out of range, a folder without images, a missing folder are one-line errors.
"""

from __future__ import annotations

import json
from pathlib import Path

from nclip.data.folders import FOLDER_TEMPLATES, FileSamples, class_folders, class_name, fingerprint, images_in
from nclip.data.types import LabelKind
from nclip.errors import NclipError


def _scan(split_dir: Path) -> dict[str, list[Path]]:
    """{class folder name: sorted images} of a split folder; each class must have images."""
    if not split_dir.is_dir():
        raise NclipError(f"image folder split not found: {split_dir}")
    classes = {c.name: images_in(c) for c in class_folders(split_dir)}
    if len(classes) < 2:
        raise NclipError(f"{split_dir}: expected one sub-folder per class (at least 2), found {len(classes)}")
    empty = next((name for name, files in classes.items() if not files), None)
    if empty is not None:
        raise NclipError(f"{split_dir / empty}: no images")
    return classes


def _samples(classes: dict[str, list[Path]], folders: list[str], space: LabelKind) -> FileSamples:
    paths, labels = [], []
    for c, name in enumerate(folders):
        paths += classes[name]
        labels += [{"class": c}] * len(classes[name])
    return FileSamples(paths, [(space.prompts(lab["class"])[0],) for lab in labels], labels)


def _train_split(split_dir: Path, folders: list[str], space: LabelKind) -> FileSamples:
    train = split_dir.parent / "train"
    classes = _scan(train)
    if sorted(classes) != folders:
        extra = sorted(set(classes) ^ set(folders))
        raise NclipError(f"{train}: its class folders differ from {split_dir}'s ({', '.join(extra[:3])}"
                         + (" ..." if len(extra) > 3 else "") + ")")
    return _samples(classes, folders, space)


def image_split(arg: str, classnames: str | None = None, templates: str | None = None):
    """The :class:`~nclip.eval.evaldata.EvalData` of ``imagefolder:DIR`` (see the module docstring)."""
    from nclip.eval import prompts
    from nclip.eval.evaldata import EvalData
    from nclip.eval.lazy_split import LazySplit

    split_dir = Path(arg).expanduser()
    classes = _scan(split_dir)
    folders = sorted(classes)
    names = prompts.class_names(classnames, folders, [class_name(f) for f in folders], "class folder")
    space = LabelKind(tuple(names), prompts.templates(templates, FOLDER_TEMPLATES))
    test = _samples(classes, folders, space)
    splits = {"test": test}
    train = split_dir.parent / "train"
    if split_dir.resolve().name != "train" and train.is_dir():
        splits["train"] = LazySplit(lambda: _train_split(split_dir, folders, space))
    root = split_dir.resolve()
    parent = root.parent.name if root.name in ("val", "test", "validation") else ""
    stem = (parent or root.name).lower()
    name = "".join(ch if ch.isalnum() or ch in "_." else "_" for ch in stem).strip("_") or "imagefolder"
    return EvalData(name=name,
                    identity={"kind": "imagefolder", "root": str(root),
                              "train": str(train.resolve()) if "train" in splits else None,
                              # the train images are listed only when a probe runs: their class
                              # folders' times stand for them (adding or removing one changes them)
                              "files": fingerprint(test.paths + ([train / f for f in folders if (train / f).is_dir()]
                                                                 if "train" in splits else []),
                                                   json.dumps([folders, space.names, space.templates]))},
                    splits=splits, label_kinds={"class": space},
                    split_dirs={"test": str(root), **({"train": str(train.resolve())} if "train" in splits else {})})

