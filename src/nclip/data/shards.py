"""Tar shards in the img2dataset / WebDataset layout: listing, reading, decoding, writing.

A shard is a tar file whose members are grouped into samples by key: ``{key}.jpg`` (or ``.jpeg``,
``.png``, ``.webp``), ``{key}.txt`` (the caption, UTF-8; further captions of the image in
``{key}.1.txt``, ``{key}.2.txt``, ...: :func:`decode_captions`) and optionally ``{key}.json`` (metadata,
e.g. labels). The key is the member path up to the first dot of its file name, as in WebDataset.

Shard specifications are brace patterns (``/data/cc3m/{00000..00331}.tar``), lists of them, or
``pipe:COMMAND`` URLs whose command writes a tar to stdout (e.g. ``pipe:aws s3 cp s3://b/x.tar -``).

Reading never raises on bad data: a sample whose image does not decode, whose caption is empty, or
which is missing a part, or which has a member larger than :func:`oversized` allows (left unread)
comes out as a :class:`Bad` record with a reason, and a tar that breaks
mid-way (truncated, corrupt header) ends its shard with one :class:`Bad` record. Callers count them.
"""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
from PIL import Image

from nclip.data.captions import list_problem
from nclip.data.folders import decoded_pixels
from nclip.errors import NclipError

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
# The most one member may hold before its record is left out unread, since a member is read whole
# into memory: a caption, its metadata or a class id is text (LAION's longest captions are a few
# KB), an image file rarely passes tens of MB. A tar header can claim any size (8 GiB and more).
TEXT_EXTS = ("txt", "json", "cls")  # and the further captions, KEY.1.txt: extension "1.txt"
MAX_TEXT_BYTES = 1 << 20
MAX_MEMBER_BYTES = 1 << 28


def oversized(name: str, ext: str, size: int) -> str | None:
    """Why member ``name`` of ``size`` bytes is too large to read, or None."""
    limit = MAX_TEXT_BYTES if ext.rpartition(".")[2] in TEXT_EXTS else MAX_MEMBER_BYTES
    if size <= limit:
        return None
    return f"member {name} claims {size:,} bytes, over the {limit:,} a .{ext} member may hold"


# --------------------------------------------------------------------------------------------
# shard lists
# --------------------------------------------------------------------------------------------


def expand_shards(spec: str | list[str]) -> list[str]:
    """Brace-expand a shard pattern or a list of them (order kept; ``::`` also separates)."""
    from braceexpand import braceexpand

    items = [spec] if isinstance(spec, str) else list(spec)
    urls: list[str] = []
    for item in items:
        for part in str(item).split("::"):
            part = part.strip()
            if not part:
                continue
            try:
                urls.extend(braceexpand(part))
            except Exception as e:  # unbalanced braces and the like
                raise NclipError(f"cannot expand shard pattern {part!r}: {e}") from None
    return urls


def check_shards(urls: list[str], what: str) -> list[str]:
    """Fail with one line if the list is empty or a local shard does not exist (pipes are trusted)."""
    if not urls:
        raise NclipError(f"{what}: the shard list is empty")
    missing = [u for u in urls if not u.startswith("pipe:") and not Path(u).is_file()]
    if missing:
        more = f" (and {len(missing) - 1} more of {len(urls)})" if len(missing) > 1 else ""
        raise NclipError(f"{what}: shard not found: {missing[0]}{more}")
    return urls


# --------------------------------------------------------------------------------------------
# records
# --------------------------------------------------------------------------------------------


@dataclass
class Record:
    """One raw sample: its key, the shard it came from, and its members' bytes by extension."""

    key: str
    url: str
    parts: dict[str, bytes]


@dataclass
class Bad:
    """A sample that cannot be used (or the broken rest of a shard), with the reason."""

    key: str
    url: str
    reason: str


def _split_key(name: str) -> tuple[str, str]:
    directory, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    key = f"{directory}/{stem}" if directory else stem
    return key, ext.lower() if dot else ""


def _open(url: str):
    if url.startswith("pipe:"):
        proc = subprocess.Popen(url[5:], shell=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        return proc.stdout, proc
    return open(url, "rb"), None


def iter_records(url: str) -> Iterator[Record | Bad]:
    """The samples of one shard in tar order; a broken tar yields one :class:`Bad` and ends."""
    try:
        stream, proc = _open(url)
    except OSError as e:
        yield Bad("", url, f"cannot open shard: {e.strerror or e}")
        return
    key, parts, too_big = None, {}, None
    try:
        try:
            with tarfile.open(fileobj=stream, mode="r|*") as tar:
                for member in tar:
                    if not member.isfile():
                        continue
                    k, ext = _split_key(member.name)
                    if k != key:
                        if key is not None:
                            yield Record(key, url, parts) if too_big is None else Bad(key, url, too_big)
                        key, parts, too_big = k, {}, None
                    too_big = too_big or oversized(member.name, ext, member.size)
                    if too_big is not None:
                        continue  # the stream skips the member's bytes in small reads
                    f = tar.extractfile(member)
                    data = f.read() if f is not None else b""
                    if len(data) != member.size:  # stream mode returns short reads at a cut
                        raise tarfile.ReadError(f"member {member.name} truncated ({len(data)} of {member.size} bytes)")
                    parts[ext] = data
        except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
            broken = f"broken tar after member {key!r}: {type(e).__name__}: {e}"
            # a header that claims more than the file holds: the skip runs into the end of the file
            yield Bad(key or "", url, broken if too_big is None else f"{too_big}; {broken}")
            return
        if key is not None:
            yield Record(key, url, parts) if too_big is None else Bad(key, url, too_big)
    finally:
        stream.close()
        if proc is not None:
            proc.wait()


def decode(rec: Record | Bad, keep_mode: bool = False) -> tuple[np.ndarray, str, dict] | Bad:
    """(image uint8 [H, W, 3] RGB, caption, json metadata) or :class:`Bad` with the reason; ``keep_mode``:
    an image that is not RGB comes as the decoded PIL image, for evaluation to convert
    (:func:`nclip.data.folders.decoded_pixels`). The caption is the sample's first
    (:func:`decode_captions`): its ``.txt`` member."""
    out = decode_captions(rec, keep_mode=keep_mode)
    return out if isinstance(out, Bad) else (out[0], out[1][0], out[2])


def decode_captions(rec: Record | Bad, json_caption_key: str | None = None,
                    keep_mode: bool = False) -> tuple[np.ndarray, tuple[str, ...], dict] | Bad:
    """(image as :func:`decode` gives it, the sample's captions, json metadata) or :class:`Bad`.

    The captions (:mod:`nclip.data.captions`): the ``.txt`` member first, then the other members whose
    extension ends in ``.txt`` (``KEY.1.txt``, ``KEY.title.txt``) in the tar's order; or, with
    ``json_caption_key``, that field of the ``.json`` member, a string or a list of strings. Each is
    stripped and the empty ones left out; a sample with none left is bad ("empty caption"), as is one
    whose caption list is empty or holds anything but strings: a stream skips and counts it
    (:mod:`nclip.data.bad_samples`), since its shards are never read whole up front."""
    if isinstance(rec, Bad):
        return rec
    ext = next((e for e in IMAGE_EXTS if e in rec.parts), None)
    if ext is None:
        return Bad(rec.key, rec.url, "no image member (.jpg/.jpeg/.png/.webp)")
    meta, broken = {}, False
    if "json" in rec.parts:
        try:
            meta = json.loads(rec.parts["json"])
        except (ValueError, UnicodeDecodeError):
            meta, broken = {}, True  # metadata is optional: a broken .json does not spoil the pair
    captions = _json_captions(meta, broken, json_caption_key) if json_caption_key else _text_captions(rec)
    if isinstance(captions, str):
        return Bad(rec.key, rec.url, captions)
    try:
        with Image.open(io.BytesIO(rec.parts[ext])) as img:
            image = decoded_pixels(img, keep_mode)
    except Exception as e:  # PIL raises many types for corrupt/truncated/bomb images
        return Bad(rec.key, rec.url, f"image does not decode: {type(e).__name__}: {str(e)[:80]}")
    height, width = (image.height, image.width) if isinstance(image, Image.Image) else image.shape[:2]
    if height < 1 or width < 1:
        return Bad(rec.key, rec.url, f"image has shape {(height, width)}")
    return image, captions, meta


def _text_captions(rec: Record) -> tuple[str, ...] | str:
    """The captions of a sample's ``.txt`` members (:func:`decode_captions`), or why it has none."""
    names = sorted((e for e in rec.parts if e == "txt" or e.endswith(".txt")), key=lambda e: e != "txt")
    if not names:
        return "no caption member (.txt)"
    try:
        texts = [rec.parts[name].decode("utf-8") for name in names]
    except UnicodeDecodeError:
        return "caption is not UTF-8"
    return tuple(t for t in (text.strip() for text in texts) if t) or "empty caption"


def _json_captions(meta, broken: bool, key: str) -> tuple[str, ...] | str:
    """The captions of the ``.json`` field ``key`` (``data.json_caption_key``), or why it has none."""
    if broken:
        return f"the .json member (data.json_caption_key {key!r}) is not valid JSON"
    if not isinstance(meta, dict) or key not in meta:
        return f"no field {key!r} (data.json_caption_key) in the .json member"
    value = [meta[key]] if isinstance(meta[key], str) else meta[key]
    if (problem := list_problem(value)) is not None:
        return problem
    return tuple(t for t in (text.strip() for text in value) if t) or "empty caption"


# --------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------


def encode_image(image: np.ndarray, fmt: str) -> bytes:
    buf = io.BytesIO()
    pil_fmt = {"jpg": "JPEG", "jpeg": "JPEG", "png": "PNG", "webp": "WEBP"}[fmt]
    kwargs = {"quality": 95} if pil_fmt in ("JPEG", "WEBP") else {}
    Image.fromarray(image).save(buf, format=pil_fmt, **kwargs)
    return buf.getvalue()


class ShardWriter:
    """Write samples to ``DIR/{00000,00001,...}.tar``, ``shard_size`` samples per shard, with
    img2dataset keys (5-digit shard id + 4-digit index). Each shard is written under a temporary
    name and renamed when complete."""

    def __init__(self, directory: str | Path, shard_size: int = 1000, image_format: str = "jpg"):
        if shard_size < 1:
            raise NclipError(f"shard size must be >= 1, got {shard_size}")
        if image_format not in IMAGE_EXTS:
            raise NclipError(f"image format must be one of {', '.join(IMAGE_EXTS)}, got {image_format!r}")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.shard_size, self.fmt = shard_size, image_format
        self.shard, self.index, self.count, self._tar, self._tmp = 0, 0, 0, None, None
        self.paths: list[Path] = []

    def write(self, image: np.ndarray, caption: str, meta: dict | None = None) -> str:
        if self._tar is None:
            self._tmp = self.dir / f".{self.shard:05d}.tar.tmp"
            self._tar = tarfile.open(self._tmp, "w")
        key = f"{self.shard:05d}{self.index:04d}"
        meta = {"key": key, "caption": caption, "width": int(image.shape[1]), "height": int(image.shape[0]),
                **(meta or {})}
        self._add(f"{key}.{self.fmt}", encode_image(image, self.fmt))
        self._add(f"{key}.txt", caption.encode("utf-8"))
        self._add(f"{key}.json", json.dumps(meta, sort_keys=True).encode("utf-8"))
        self.index += 1
        self.count += 1
        if self.index == self.shard_size:
            self._finish()
        return key

    def _add(self, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(data), 0, 0o644
        self._tar.addfile(info, io.BytesIO(data))

    def _finish(self) -> None:
        if self._tar is None:
            return
        self._tar.close()
        final = self.dir / f"{self.shard:05d}.tar"
        self._tmp.replace(final)
        self.paths.append(final)
        self._tar, self.shard, self.index = None, self.shard + 1, 0

    def close(self) -> list[Path]:
        self._finish()
        return self.paths

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is not None and self._tar is not None:
            self._tar.close()
            self._tmp.unlink(missing_ok=True)
            self._tar = None
            return False
        self.close()
        return False

    def pattern(self) -> str:
        """The brace pattern naming every shard written."""
        n = len(self.paths)
        if n == 1:
            return str(self.paths[0])
        return str(self.dir / f"{{00000..{n - 1:05d}}}.tar")
