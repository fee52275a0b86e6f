"""CLIP_benchmark's WebDataset copies (``--dataset wds:DIR[:SPLIT]``), read offline.

The layout ``clip_benchmark_export_wds`` writes (and the ``clip-benchmark/wds_*`` copies hold)::

    DIR/classnames.txt                            one class name per line, in class-index order
    DIR/zeroshot_classification_templates.txt     one prompt per line, ``{c}`` (or ``{}``) for the name
    DIR/dataset_type.txt                          optional: ``retrieval`` for image-text data
    DIR/<split>/nshards.txt                       N, the number of shards
    DIR/<split>/0.tar ... DIR/<split>/N-1.tar     samples ``<key>.webp|jpg|png`` + ``<key>.cls`` (class
                                                  index) or ``<key>.txt`` (captions, one per line)

``SPLIT`` defaults to ``test``: zero-shot classification (or, with ``dataset_type.txt`` =
``retrieval``, image-text retrieval) runs on it. When it is ``test`` and ``DIR/train/`` is a copy
too, that split trains the linear and k-NN probes (indexed only when a probe runs). The user's
``--classnames`` / ``--templates`` replace the files' names and prompts.

Shards are indexed, not streamed: each tar's headers are read once (member offsets and sizes, the
small ``cls``/``txt`` members' bytes) and an image is read by seeking to it when a protocol asks.
The ``webdataset`` library streams shards and has no random access, so only its key convention
(:func:`webdataset.tariterators.base_plus_ext`: the key is the member name up to the first dot of
its file name) is taken from it, which is how CLIP_benchmark's writer groups a sample.

A damaged or incomplete copy (a missing ``nshards.txt`` or shard, a tar that does not read, a
sample without an image, a class index out of range) is one :class:`~nclip.errors.NclipError`
naming the file and the sample.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Sequence
from pathlib import Path

from nclip.data.folders import decoded_pixels, fingerprint
from nclip.data.shards import oversized
from nclip.data.types import LabelKind, Sample
from nclip.errors import NclipError

WDS_IMAGE_EXTS = ("webp", "jpg", "jpeg", "png")  # CLIP_benchmark writes webp, jpg or png
DEFAULT_SPLIT = "test"
CLASSNAMES, TEMPLATES, DATASET_TYPE = "classnames.txt", "zeroshot_classification_templates.txt", "dataset_type.txt"


def split_path_arg(arg: str, kind: str, default: str) -> tuple[Path, str]:
    """``DIR[:SPLIT]`` -> (DIR, SPLIT or ``default``); a last part with a ``/`` is part of the path."""
    path, sep, split = arg.rpartition(":")
    if not sep or "/" in split or not path:
        path, split = arg, default
    if not split.strip():
        raise NclipError(f"{kind}:{arg}: empty split name")
    return Path(path).expanduser(), split.strip()


def dataset_name(root: Path) -> str:
    """``/data/wds_cifar10`` -> ``cifar10`` (the ``wds_`` prefix of the copies' names dropped)."""
    stem = root.resolve().name.lower()
    stem = stem[4:] if stem.startswith("wds_") and len(stem) > 4 else stem
    clean = "".join(ch if ch.isalnum() or ch in "_." else "_" for ch in stem).strip("_")
    return clean or "wds"


class TarSamples(Sequence):
    """Samples of indexed shards: the image read from its shard by offset on access, decoded to RGB as
    CLIP_benchmark's webdataset reader decodes it (``keep_mode``: see :class:`nclip.data.folders.FileSamples`)."""

    keep_mode = False

    def __init__(self, images: list[tuple[Path, int, int, str]], captions: list[tuple[str, ...]],
                 labels: list[dict[str, int]], label_kinds: dict[str, LabelKind]):
        self.images, self.captions, self.labels, self.label_kinds = images, captions, labels, label_kinds

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        from PIL import Image

        shard, offset, size, key = self.images[i]
        try:
            with open(shard, "rb") as fh:
                fh.seek(offset)
                data = fh.read(size)
            with Image.open(io.BytesIO(data)) as im:
                image = decoded_pixels(im, keep_mode=self.keep_mode)
        except Exception as e:  # PIL raises many types for a corrupt image
            raise NclipError(f"{shard}: sample {key!r}: image does not decode "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
        caps = self.captions[i]
        return Sample(image=image, caption=caps[0], captions=caps, labels=dict(self.labels[i]))


def shard_paths(split_dir: Path, root: Path) -> list[Path]:
    """``split_dir/0.tar ... N-1.tar`` as ``nshards.txt`` counts them, each checked to exist."""
    if not split_dir.is_dir():
        splits = sorted(p.name for p in root.iterdir() if p.is_dir() and (p / "nshards.txt").is_file())
        raise NclipError(f"{root}: no split {split_dir.name!r} (splits here: {', '.join(splits) or 'none'})")
    counter = split_dir / "nshards.txt"
    if not counter.is_file():
        raise NclipError(f"{counter}: not found (a CLIP_benchmark split folder holds nshards.txt and "
                         "0.tar ... N-1.tar)")
    text = counter.read_text(encoding="utf-8", errors="replace").strip()
    if not text.isdigit() or int(text) < 1:
        raise NclipError(f"{counter}: expected the number of shards (a positive integer), got {text[:40]!r}")
    shards = [split_dir / f"{n}.tar" for n in range(int(text))]
    missing = [p for p in shards if not p.is_file()]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise NclipError(f"{missing[0]}: shard not found{more}; nshards.txt says {len(shards)} shards")
    return shards


def _index_shard(shard: Path) -> list[tuple[str, dict[str, tuple[int, int]], dict[str, bytes]]]:
    """[(key, {ext: (data offset, size)}, {small ext: bytes})] of one tar, in tar order."""
    from webdataset.tariterators import base_plus_ext

    out: list = []
    total = shard.stat().st_size
    try:
        with tarfile.open(shard, mode="r:") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, ext = base_plus_ext(member.name)
                if key is None:
                    continue
                ext = ext.lower()
                if member.offset_data + member.size > total:
                    raise tarfile.ReadError(f"member {member.name} truncated")
                too_big = oversized(member.name, ext, member.size)  # every member is read whole
                if too_big is not None:
                    raise NclipError(f"{shard}: sample {key!r}: {too_big}")
                if not out or out[-1][0] != key:
                    out.append((key, {}, {}))
                out[-1][1][ext] = (member.offset_data, member.size)
                if ext in ("cls", "txt"):
                    f = tar.extractfile(member)
                    out[-1][2][ext] = f.read() if f is not None else b""
    except (tarfile.TarError, EOFError, OSError) as e:
        raise NclipError(f"{shard}: not a readable tar ({type(e).__name__}: {e})") from None
    return out


def index_split(split_dir: Path, root: Path, num_classes: int | None, names_from: str,
                space: LabelKind | None) -> TarSamples:
    """The samples of a split: class-labelled (``num_classes``: names read) or captioned (None)."""
    images, captions, labels = [], [], []
    for shard in shard_paths(split_dir, root):
        for key, members, small in _index_shard(shard):
            where = f"{shard}: sample {key!r}"
            ext = next((e for e in WDS_IMAGE_EXTS if e in members), None)
            if ext is None:
                raise NclipError(f"{where}: no image (.{', .'.join(WDS_IMAGE_EXTS)})")
            images.append((shard, *members[ext], key))
            if num_classes is None:
                captions.append(_captions(small.get("txt"), where))
                labels.append({})
                continue
            y = _class_index(small.get("cls"), where)
            if not 0 <= y < num_classes:
                raise NclipError(f"{where}: class index {y} out of range for {num_classes} class names ({names_from})")
            captions.append((space.prompts(y)[0],))
            labels.append({"class": y})
    if not images:
        raise NclipError(f"{split_dir}: the shards hold no samples")
    return TarSamples(images, captions, labels, {"class": space} if space is not None else {})


def _class_index(raw: bytes | None, where: str) -> int:
    if raw is None:
        raise NclipError(f"{where}: no class index (.cls)")
    text = raw.decode("utf-8", errors="replace").strip()
    try:
        return int(text)
    except ValueError:
        raise NclipError(f"{where}: class index {text[:20]!r} is not an integer") from None


def _captions(raw: bytes | None, where: str) -> tuple[str, ...]:
    """CLIP_benchmark's retrieval captions: one per line (a newline inside a caption written as ``\\n``)."""
    if raw is None:
        raise NclipError(f"{where}: no captions (.txt)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise NclipError(f"{where}: captions are not UTF-8") from None
    caps = tuple(dict.fromkeys(c.replace("\\n", " ").strip() for c in text.splitlines() if c.strip()))
    if not caps:
        raise NclipError(f"{where}: empty captions (.txt)")
    return caps


def _lines(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]


def _benchmark_templates(path: Path) -> tuple[str, ...]:
    """CLIP_benchmark's templates, ``{c}`` rewritten as nclip's ``{}``; a line without exactly one
    placeholder is an error naming ``file:line``."""
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        text = line.strip()
        if not text:
            continue
        text = text.replace("{c}", "{}")
        if text.count("{}") != 1 or text.replace("{}", "").count("{") or text.replace("{}", "").count("}"):
            raise NclipError(f"{path}:{n}: a template needs exactly one {{c}} (the class name), got {line.strip()!r}")
        out.append(text)
    if not out:
        raise NclipError(f"{path}: no templates")
    return tuple(out)


def _label_space(root: Path, classnames: str | None, templates: str | None) -> tuple[LabelKind, str]:
    """(the class names and prompts, where the names came from) of a classification copy."""
    from nclip.eval import prompts

    names_file, templates_file = root / CLASSNAMES, root / TEMPLATES
    if names_file.is_file():
        keys = _lines(names_file)
        names = prompts.class_names(classnames, keys, keys, "class")
        names_from = str(classnames or names_file)
    elif classnames is not None:
        from nclip.jsonio import read_text

        path, text = read_text(classnames, "--classnames: file")
        names, names_from = tuple(line.strip() for line in text.splitlines() if line.strip()), str(path)
    else:
        raise NclipError(f"{names_file}: not found (a classification copy holds its class names; "
                         "or give --classnames FILE)")
    if not names:
        raise NclipError(f"{names_from}: no class names")
    if templates is None and not templates_file.is_file():
        raise NclipError(f"{templates_file}: not found (or give --templates FILE|imagenet80)")
    chosen = prompts.templates(templates, ()) if templates is not None else _benchmark_templates(templates_file)
    return LabelKind(tuple(names), chosen), names_from


def wds_benchmark(arg: str, classnames: str | None = None, templates: str | None = None):
    """The :class:`~nclip.eval.evaldata.EvalData` of ``wds:DIR[:SPLIT]`` (see the module docstring)."""
    from nclip.eval.evaldata import EvalData
    from nclip.eval.lazy_split import LazySplit

    root, split = split_path_arg(arg, "wds", DEFAULT_SPLIT)
    if not root.is_dir():
        raise NclipError(f"wds dataset folder not found: {root}")
    kind = (root / DATASET_TYPE).read_text(encoding="utf-8", errors="replace").strip().lower() \
        if (root / DATASET_TYPE).is_file() else "classification"
    if kind not in ("classification", "retrieval"):
        raise NclipError(f"{root / DATASET_TYPE}: dataset type {kind[:40]!r} is not supported "
                         "(classification or retrieval)")
    retrieval = kind == "retrieval"
    space, names_from = (None, "") if retrieval else _label_space(root, classnames, templates)
    n_classes = None if retrieval else len(space)
    test = index_split(root / split, root, n_classes, names_from, space)
    splits: dict[str, Sequence] = {"test": test}
    files = [p for p in (root / CLASSNAMES, root / TEMPLATES, root / DATASET_TYPE) if p.is_file()]
    files += shard_paths(root / split, root)
    if split == DEFAULT_SPLIT and not retrieval and (root / "train" / "nshards.txt").is_file():
        files += shard_paths(root / "train", root)  # checked now, indexed when a probe runs
        splits["train"] = LazySplit(lambda: index_split(root / "train", root, n_classes, names_from, space))
    return EvalData(
        name=dataset_name(root),
        identity={"kind": "wds", "root": str(root.resolve()), "split": split,
                  "files": fingerprint(files, json.dumps([space.names, space.templates] if space else None))},
        splits=splits, label_kinds={"class": space} if space is not None else {}, retrieval=retrieval)
