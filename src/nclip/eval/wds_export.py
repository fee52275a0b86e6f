"""``nclip data write-shards --layout clip_benchmark``: an evaluation dataset written as CLIP_benchmark's
WebDataset copy, so that CLIP_benchmark (``--dataset wds/NAME --dataset_root DIR``) and ``nclip eval
--dataset wds:DIR`` read the same files.

Any dataset spec ``nclip eval`` reads is written (:mod:`nclip.eval.datasets`): the built-in scenes
and digits, class folders (``folder:DIR``, ``imagefolder:DIR``, ``realms:DIR``), a captions file
(``captions:FILE.csv``), a Karpathy split, another copy. The layout is the one CLIP_benchmark's
exporter (``clip_benchmark.webdataset_builder.convert_dataset``) writes and
:mod:`nclip.eval.wds_benchmark` documents: ``classnames.txt`` and
``zeroshot_classification_templates.txt`` (``{c}`` for the name) for one label kind, or
``dataset_type.txt`` = ``retrieval`` with each image's captions one per line; ``SPLIT/0.tar ...``
with keys ``s0000000, s0000001, ...`` and ``SPLIT/nshards.txt``.

The images are the data's own bytes where it has them: a JPEG, PNG or WebP file is copied as it is
(as the exporter's ``path_to_bytes`` does), so both tools decode the same file, at its size and in
its mode. Images without a file (the built-in data, other formats, images inside tar shards) are
encoded: an RGB image in ``image_format`` (WebP and PNG lossless; JPEG at quality 95), any other mode
as PNG, which keeps the mode.

The copy is written into a temporary folder beside ``out`` and renamed to ``out`` when complete, so an
interrupted write leaves nothing that looks like a copy.
"""

from __future__ import annotations

import io
import os
import shutil
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from nclip.errors import NclipError
from nclip.eval.wds_benchmark import CLASSNAMES, DATASET_TYPE, DEFAULT_SPLIT, TEMPLATES

# a file of these formats is copied as it is; the key is the extension CLIP_benchmark's reader looks for
COPIED_EXTS = {".jpg": "jpg", ".jpeg": "jpg", ".png": "png", ".webp": "webp"}
IMAGE_FORMATS = ("webp", "png", "jpg")
_PIL_SAVE = {"webp": {"format": "WEBP", "lossless": True, "exact": True}, "png": {"format": "PNG"},
             "jpg": {"format": "JPEG", "quality": 95}}


@dataclass
class Written:
    """What :func:`write_copy` wrote: ``task`` (classification or retrieval), samples per split,
    shards per split, the label kind and its number of classes (classification)."""

    root: Path
    task: str
    samples: dict[str, int] = field(default_factory=dict)
    shards: dict[str, int] = field(default_factory=dict)
    label: str | None = None
    classes: int = 0


def copy_dataset(spec: str, out: str | Path, cfg, count: int | None = None, classnames: str | None = None,
                 templates: str | None = None, image_key: str | None = None, caption_key: str | None = None,
                 **options) -> Written:
    """Read the dataset spec ``spec`` as ``nclip eval --dataset`` does and :func:`write_copy` it. The run
    config ``cfg`` gives the built-in data's image size, objects per scene and seed; their splits hold
    ``count`` samples (default: ``nclip eval``'s, so the copy is the data it evaluates)."""
    from nclip.eval import datasets
    from nclip.eval.settings import EvalSettings

    if count is not None and count < 1:
        raise NclipError(f"--count must be >= 1, got {count}")
    defaults = EvalSettings()
    (data,) = datasets.build(spec, image_size=cfg.data.image_size, max_objects=cfg.data.max_objects, seed=cfg.seed,
                             test_samples=count or defaults.test_samples, train_samples=count or defaults.train_samples,
                             sts_pairs=0, classnames=classnames, templates=templates, image_key=image_key,
                             caption_key=caption_key, run_keys=cfg.data.caption_keys())
    return write_copy(data, out, count=count, **options)


def write_copy(data, out: str | Path, label: str | None = None, retrieval: bool = False,
               split: str | None = None, count: int | None = None, shard_size: int = 1000,
               image_format: str = "webp") -> Written:
    """Write the :class:`~nclip.eval.evaldata.EvalData` ``data`` to ``out`` in CLIP_benchmark's layout.

    ``retrieval`` writes the test images with their captions; otherwise the classes of ``label``
    (default: the data's first label kind) for the test split and, where the data has one, the train
    split (the probes' training set). ``split`` writes that split alone; ``count`` the first
    ``count`` samples of each split."""
    out = Path(out).expanduser()
    _check_empty(out)
    if shard_size < 1:
        raise NclipError(f"--shard-size must be >= 1, got {shard_size}")
    if count is not None and count < 1:
        raise NclipError(f"--count must be >= 1, got {count}")
    if image_format not in IMAGE_FORMATS:
        raise NclipError(f"--format must be one of {', '.join(IMAGE_FORMATS)}, got {image_format!r}")
    task, kind = _task(data, label, retrieval)
    splits = _splits(data, task, split)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        written = Written(root=out, task=task, label=kind)
        if task == "retrieval":
            (tmp / DATASET_TYPE).write_text("retrieval\n", encoding="utf-8")
        else:
            space = data.label_kinds[kind]
            written.classes = len(space)
            (tmp / CLASSNAMES).write_text("".join(f"{_one_line(n, 'class name')}\n" for n in space.names),
                                          encoding="utf-8")
            (tmp / TEMPLATES).write_text("".join(f"{_benchmark_template(t)}\n" for t in space.templates),
                                         encoding="utf-8")
        for name in splits:
            samples = data.splits[name]
            n = len(samples) if count is None else min(count, len(samples))
            written.shards[name] = _write_split(samples, n, tmp / name, task, kind, shard_size, image_format)
            written.samples[name] = n
        if out.exists():
            out.rmdir()  # empty (checked above): the rename below needs it gone
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return written


def _check_empty(out: Path) -> None:
    if out.is_file():
        raise NclipError(f"--out {out}: a file; CLIP_benchmark's copy is a folder")
    if out.is_dir() and any(out.iterdir()):
        raise NclipError(f"--out {out}: not empty; write a CLIP_benchmark copy to a new or empty folder")


def _task(data, label: str | None, retrieval: bool) -> tuple[str, str | None]:
    """("retrieval", None) or ("classification", the label kind written)."""
    if retrieval:
        if label is not None:
            raise NclipError("--label and --retrieval: a CLIP_benchmark copy holds classes or captions, not both")
        if not data.retrieval:
            raise NclipError(f"{data.name}: no captions to write for retrieval (its samples have class labels only)")
        return "retrieval", None
    if not data.label_kinds:
        if data.retrieval and label is None:
            return "retrieval", None
        raise NclipError(f"{data.name}: no single-label classes to write"
                         + (f" (--label {label})" if label else ""))
    kinds = list(data.label_kinds)
    kind = label if label is not None else kinds[0]
    if kind not in data.label_kinds:
        raise NclipError(f"--label {kind!r}: {data.name} has the label kinds {', '.join(kinds)}")
    return "classification", kind


def _splits(data, task: str, split: str | None) -> list[str]:
    if split is not None:
        if split not in data.splits:
            raise NclipError(f"--split {split!r}: {data.name} has the splits {', '.join(sorted(data.splits))}")
        return [split]
    if DEFAULT_SPLIT not in data.splits:
        raise NclipError(f"{data.name}: no test split to write")
    # the train split trains the probes of a classification copy; retrieval has none
    return [DEFAULT_SPLIT] + (["train"] if task == "classification" and "train" in data.splits else [])


def _one_line(text: str, what: str) -> str:
    """``text`` if it reads back as itself from one line of a text file (both readers strip each line)."""
    if not text.strip() or text.strip() != text or len(text.splitlines()) != 1:
        raise NclipError(f"{what} {text!r}: cannot be written as one line of {CLASSNAMES}")
    return text


def _benchmark_template(template: str) -> str:
    """nclip's ``{}`` template as CLIP_benchmark's ``{c}`` one (it fills them with ``str.format(c=name)``)."""
    bare = template.replace("{}", "")
    if template.count("{}") != 1 or "{" in bare or "}" in bare:
        raise NclipError(f"template {template!r}: a CLIP_benchmark template has exactly one place for the "
                         "class name and no other braces")
    return _one_line(template.replace("{}", "{c}"), "template")


def _caption_lines(captions: Sequence[str]) -> bytes:
    """One caption per line; a line break inside a caption becomes a space, since both readers split
    the member at every line boundary (``str.splitlines``)."""
    lines = [" ".join(c.splitlines()).strip() for c in captions]
    return "\n".join(c for c in lines if c).encode("utf-8")


def _image_member(samples, i: int, sample, image_format: str) -> tuple[str, bytes]:
    """(extension, bytes) of sample ``i``'s image: its file copied where CLIP_benchmark reads the
    format, else the decoded image encoded (see the module docstring)."""
    paths = getattr(samples, "paths", None)
    if paths is not None:
        ext = COPIED_EXTS.get(Path(paths[i]).suffix.lower())
        if ext is not None:
            return ext, Path(paths[i]).read_bytes()
    from PIL import Image

    image = sample.image
    pil = image if isinstance(image, Image.Image) else Image.fromarray(np.ascontiguousarray(image))
    fmt = image_format if pil.mode == "RGB" else "png"
    buf = io.BytesIO()
    pil.save(buf, **_PIL_SAVE[fmt])
    return fmt, buf.getvalue()


def _write_split(samples, n: int, folder: Path, task: str, kind: str | None, shard_size: int,
                 image_format: str) -> int:
    """Shards ``folder/0.tar ...`` of the first ``n`` samples and ``folder/nshards.txt``; the shard count."""
    folder.mkdir()
    shards = 0
    tar = None
    try:
        for i in range(n):
            if i % shard_size == 0:
                if tar is not None:
                    tar.close()
                tar = tarfile.open(folder / f"{shards}.tar", "w")
                shards += 1
            sample = samples[i]  # decoding checks the image: a bad one is an error naming its file
            key = f"s{i:07d}"
            ext, data = _image_member(samples, i, sample, image_format)
            _add(tar, f"{key}.{ext}", data)
            if task == "retrieval":
                _add(tar, f"{key}.txt", _caption_lines(sample.captions))
            elif kind in sample.labels:
                _add(tar, f"{key}.cls", str(int(sample.labels[kind])).encode("ascii"))
            else:
                raise NclipError(f"sample {i} of the {folder.name} split has no {kind!r} class")
    finally:
        if tar is not None:
            tar.close()
    (folder / "nshards.txt").write_text(f"{shards}\n", encoding="utf-8")
    return shards


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    tar.addfile(info, io.BytesIO(data))


def describe(w: Written) -> str:
    """What was written, and the command lines of both tools that evaluate it (docs/eval-data.md)."""
    what = (f"{w.classes} classes of {w.label!r}" if w.task == "classification" else "captions")
    parts = [f"{n} {split} sample{'s' * (n != 1)} in {w.shards[split]} shard{'s' * (w.shards[split] != 1)}"
             for split, n in w.samples.items()]
    task = "zeroshot_classification" if w.task == "classification" else "zeroshot_retrieval"
    name = w.root.resolve().name
    # webdataset gives each DataLoader worker whole shards, and a worker without one stops the run
    workers = min(4, w.shards.get(DEFAULT_SPLIT, 1))
    return "\n".join([
        f"wrote CLIP_benchmark's layout ({w.task}, {what}) to {w.root}: {', '.join(parts)}",
        f"  nclip eval --checkpoint RUN --out EVAL --dataset wds:{w.root} "
        f"--tasks {'zeroshot' if w.task == 'classification' else 'retrieval'}",
        f"  clip_benchmark eval --dataset wds/{name} --dataset_root {w.root} --model local-dir:EXPORT "
        f"--pretrained none --no_amp --task {task} --num_workers {workers} --output {name}.json"
        + (" --recall_k 1 5 10" if w.task == "retrieval" else ""),
    ])
