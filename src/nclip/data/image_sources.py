"""Images of any nclip data source, by identifier, for tools that only look at pixels (``nclip data dedup``).

A source string is one of

* ``synthetic[:SPLIT[:N]]`` / ``digits[:SPLIT[:N]]``: a built-in dataset (default split ``train``;
  ``N`` the first N samples, default: the run config's ``data.train_length`` for synthetic, the
  whole split for digits), made by :func:`nclip.data.sources.build_dataset` with the given run
  config; identifiers ``synthetic:test:17``;
* a ``.csv`` / ``.tsv`` file with an image-path column (read by :func:`nclip.data.csv_source.read_rows`);
  identifiers are the resolved image paths, as the training loader sees them;
* a shard pattern (``/data/{00000..00009}.tar``, ``pipe:...``) or a directory holding ``.tar``
  shards (listed by :func:`nclip.data.tools.shard_urls`, read by :func:`nclip.data.shards.iter_records`);
  identifiers are the sample keys;
* any other directory: every image file below it (recursively, so class folders work too);
  identifiers are the file paths.

Sources are streamed (iterate an :class:`ImageSource` for (identifier, opener) pairs), so a large
shard set is never held in memory; :meth:`ImageSource.open_many` reopens a few items later (thumbnails).
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable, Iterator
from pathlib import Path

from PIL import Image

from nclip.defaults import BUILTIN_SOURCES
from nclip.errors import NclipError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


class ImageSource:
    """A data source as a stream of (identifier, opener) pairs; ``opener()`` gives the PIL image.

    ``kind``: builtin, csv, webdataset or folder. ``csv_rows``: for a CSV, ``(path, image column)``
    so that a filtered copy can be written. ``bad``: (identifier, reason) of shard samples without
    an image, filled while iterating.
    """

    def __init__(self, spec: str, kind: str, items: Callable[[], Iterator[tuple[str, Callable[[], Image.Image]]]],
                 csv_rows: tuple[str, str] | None = None):
        self.spec, self.kind, self._items, self.csv_rows = spec, kind, items, csv_rows
        self.bad: list[tuple[str, str]] = []

    def __iter__(self) -> Iterator[tuple[str, Callable[[], Image.Image]]]:
        return self._items()

    def open_many(self, ids: set[str]) -> dict[str, Image.Image]:
        """{identifier: image} for a few identifiers (a second pass over the source: for thumbnails)."""
        return {key: opener() for key, opener in self if key in ids}


def _builtin(spec: str, name: str, rest: str, config: Callable[[str], object]) -> ImageSource:
    from nclip.data.sources import build_dataset

    split, _, count = rest.partition(":")
    split = split or "train"
    if split not in ("train", "val", "test"):
        raise NclipError(f"{spec}: the split must be train, val or test, got {split!r}")
    if count and (not count.isdigit() or int(count) < 1):
        raise NclipError(f"{spec}: the sample count must be a positive integer, got {count!r}")
    data = build_dataset(config(name), split, length=int(count) if count else None)
    n = min(int(count), len(data)) if count else len(data)

    def items():
        for i in range(n):
            yield f"{name}:{split}:{i}", functools.partial(lambda i: Image.fromarray(data[i].image), i)

    return ImageSource(spec, "builtin", items)


def _files(spec: str, kind: str, paths: list[str], csv_rows=None) -> ImageSource:
    return ImageSource(spec, kind, lambda: ((p, functools.partial(Image.open, p)) for p in paths), csv_rows)


def _csv(spec: str, image_key: str) -> ImageSource:
    from nclip.data.csv_source import read_rows

    # read_rows also checks a caption column; pixels need none, so the image column stands in for it
    images, _ = read_rows(spec, image_key, image_key)
    return _files(spec, "csv", images, csv_rows=(spec, image_key))


def _shards(spec: str) -> ImageSource:
    from nclip.data.shards import IMAGE_EXTS, Bad, iter_records
    from nclip.data.tools import shard_urls

    urls = shard_urls(spec)

    def items():  # streamed: one sample's bytes in memory at a time
        source.bad.clear()
        for url in urls:
            for rec in iter_records(url):
                ext = None if isinstance(rec, Bad) else next((e for e in IMAGE_EXTS if e in rec.parts), None)
                if ext is None:
                    source.bad.append((rec.key or url, getattr(rec, "reason", "no image member")))
                    continue
                yield rec.key, functools.partial(lambda b: Image.open(io.BytesIO(b)), rec.parts[ext])

    source = ImageSource(spec, "webdataset", items)
    return source


def _folder(root: Path, spec: str) -> ImageSource:
    files = sorted(str(p) for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if not files:
        raise NclipError(f"{spec}: no images ({', '.join(IMAGE_SUFFIXES)}) in this folder or below it")
    return _files(spec, "folder", files)


def open_source(spec: str, config: Callable[[str], object], csv_image_key: str = "filepath") -> ImageSource:
    """The :class:`ImageSource` of a source string (see the module docstring).

    ``config(name)`` returns the run config for the built-in source ``name`` (its seed, image size
    and lengths); it is called only for built-in sources.
    """
    spec = spec.strip()
    name, _, rest = spec.partition(":")
    path = Path(spec).expanduser()
    if name in BUILTIN_SOURCES and not path.exists():
        return _builtin(spec, name, rest, config)
    if spec.lower().endswith((".csv", ".tsv")):
        return _csv(str(path), csv_image_key)
    if path.is_dir():
        if any(path.glob("*.tar")):
            return _shards(str(path))
        return _folder(path, spec)
    if "{" in spec or spec.startswith("pipe:") or spec.lower().endswith(".tar"):
        return _shards(spec)
    what = "not a data source" if path.exists() else "not found"
    raise NclipError(f"{spec}: {what} (expected an image folder, a .csv/.tsv file, a shard pattern or directory, "
                     f"or a built-in source {' / '.join(f'{s}[:SPLIT[:N]]' for s in BUILTIN_SOURCES)})")
