"""The rows ``nclip embed`` encodes, from a data spec: everything ``nclip eval --dataset`` reads
(:func:`nclip.eval.datasets.build`: ``synthetic``, ``digits``, ``folder:``, ``captions:``,
``imagefolder:``, ``wds:``, ``karpathy:``, ...; every split, in the order the reader gives them),
a bare ``.csv`` / ``.tsv`` / ``.jsonl`` file (as ``captions:FILE``), and training WebDataset shards
(``shards:PATTERN``, or a bare shard pattern / directory of ``.tar``; read by
:func:`nclip.data.shards.iter_records`, in shard and tar order).

Rows come in chunks (one per output shard) of ``Sample`` sequences whose images are read on access,
so that :func:`nclip.eval.features._decoded_batches` decodes the next batch while the model encodes
this one, and a resumed run skips the rows already embedded without decoding them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from nclip.data.types import Sample
from nclip.errors import NclipError

TABLE_SUFFIXES = (".csv", ".tsv", ".jsonl", ".ndjson")


@dataclass
class Rows:
    """A data spec's rows. ``chunks(start, size)`` yields (samples, where) per chunk of at most
    ``size`` rows from source position ``start``: ``where`` [len(samples)] the path (or shard#key)
    of each row, or None; and after each chunk, ``position()`` is the source position past it (a
    shard stream skips undecodable records, so positions and rows differ there)."""

    spec: str
    identity: dict  # changes whenever the data would (a resumed run must read the same rows)
    captions: bool  # rows carry real captions (text embeddings are written)
    total: int | None  # rows, where known before reading
    label_names: dict[str, tuple[str, ...]]  # names of each label kind's classes
    chunks: Callable[[int, int], Iterator[tuple[Sequence[Sample], list[str | None]]]]
    position: Callable[[], int]
    skipped: list[str]  # "where: reason" of shard records left out


def open_rows(spec: str, *, image_size: int, max_objects: int, seed: int, samples: int,
              image_key: str | None = None, caption_key: str | None = None,
              run_keys: tuple[str, ...] | None = None) -> Rows:
    """The rows of ``spec`` (see the module docstring); ``samples``: the synthetic scenes per split."""
    from nclip.eval import datasets

    if spec.startswith("shards:") or _is_shards(spec):
        return _shard_rows(spec)
    path = Path(spec).expanduser()
    if ":" not in spec and path.suffix.lower() in TABLE_SUFFIXES:
        spec = f"captions:{spec}"
    built = datasets.build(spec, image_size=image_size, max_objects=max_objects, seed=seed, test_samples=samples,
                           train_samples=samples, sts_pairs=0, image_key=image_key, caption_key=caption_key,
                           run_keys=run_keys)
    data = built[0]
    if not data.splits:
        raise NclipError(f"{spec}: holds no images to embed (sentence pairs only)")
    return eval_rows(spec, data)


def _is_shards(spec: str) -> bool:
    path = Path(spec).expanduser()
    return spec.endswith(".tar") or "{" in spec and ".tar" in spec or (path.is_dir() and any(path.glob("*.tar")))


def eval_rows(spec: str, data) -> Rows:
    """Every split of an :class:`~nclip.eval.evaldata.EvalData`, one after the other (also rows made
    in memory: the bench's)."""
    parts = [(split, samples) for split, samples in data.splits.items()]
    for _, samples in parts:  # a file is embedded as open_clip's preprocess embeds Image.open of it
        files = getattr(samples, "samples", samples)  # (nclip.eval.lazy_split.LazySplit: its samples)
        if hasattr(files, "keep_mode"):
            files.keep_mode = True
    bounds, total = [], 0
    for _, samples in parts:
        bounds.append(total)
        total += len(samples)
    state = {"position": 0}

    def locate(i: int) -> tuple[str, Sequence[Sample], int]:
        n = max(j for j, b in enumerate(bounds) if b <= i)
        return parts[n][0], parts[n][1], i - bounds[n]

    def chunks(start: int, size: int):
        state["position"] = start
        while state["position"] < total:
            stop = min(state["position"] + size, total)
            rows = [locate(i) for i in range(state["position"], stop)]
            state["position"] = stop  # before the yield: the caller reads it once the chunk is written
            yield _Lazy([(s, j) for _, s, j in rows], [split for split, _, _ in rows]), \
                [_where(s, j) for _, s, j in rows]

    names = {kind: space.names for kind, space in data.label_kinds.items()}
    return Rows(spec, {"spec": spec, "source": data.identity, "splits": {k: len(v) for k, v in parts}},
                data.retrieval, total, names, chunks, lambda: state["position"], [])


class _Lazy(Sequence):
    """Samples read on access (by the decoding threads), each labelled with its split."""

    def __init__(self, items: list[tuple[Sequence[Sample], int]], splits: list[str]):
        self.items, self.splits = items, splits

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Sample:
        samples, j = self.items[i]
        return samples[j]


def _where(samples, j: int) -> str | None:
    """A row's file: the image path of file-backed data, SHARD#KEY of a benchmark shard, else None."""
    paths = getattr(samples, "paths", None)
    if paths is not None:
        return str(paths[j])
    images = getattr(samples, "images", None)  # nclip.eval.wds_benchmark.TarSamples: (shard, offset, size, key)
    if isinstance(images, list) and images and isinstance(images[j], tuple) and len(images[j]) == 4:
        return f"{images[j][0]}#{images[j][3]}"
    return None


def _shard_rows(spec: str) -> Rows:
    """Training WebDataset shards (image + ``.txt`` caption per key) as a stream of rows; a record
    without an image or caption, or a broken tar, is left out and listed in ``skipped``."""
    from nclip.data.folders import fingerprint
    from nclip.data.shards import IMAGE_EXTS, Bad, iter_records
    from nclip.data.tools import shard_urls

    source = spec[len("shards:"):] if spec.startswith("shards:") else spec
    urls = shard_urls(str(Path(source).expanduser()) if "{" not in source else source)
    local = [Path(u) for u in urls if not u.startswith("pipe:")]
    state = {"position": 0}
    skipped: list[str] = []

    def records() -> Iterator:
        for url in urls:
            yield from iter_records(url)

    def chunks(start: int, size: int):
        state["position"] = 0
        chunk = []
        for rec in records():
            state["position"] += 1
            bad = isinstance(rec, Bad) or not any(e in rec.parts for e in IMAGE_EXTS)
            if bad:
                skipped.append(f"{rec.url}#{rec.key}: {rec.reason if isinstance(rec, Bad) else 'no image member'}")
            if bad or state["position"] <= start:
                continue
            chunk.append(rec)
            if len(chunk) == size:
                yield _Records(chunk), [f"{r.url}#{r.key}" for r in chunk]
                chunk = []
        if chunk:
            yield _Records(chunk), [f"{r.url}#{r.key}" for r in chunk]

    identity = {"spec": spec, "shards": urls, "files": fingerprint(local) if local else None}
    return Rows(spec, identity, True, None, {}, chunks, lambda: state["position"], skipped)


class _Records(Sequence):
    """Shard records decoded on access (by the decoding threads); one that does not decode is an error."""

    def __init__(self, records: list):
        self.records = records
        self.splits = [""] * len(records)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> Sample:
        from nclip.data.shards import Bad, decode

        out = decode(self.records[i], keep_mode=True)
        if isinstance(out, Bad):
            raise NclipError(f"{out.url}#{out.key}: {out.reason}")
        image, caption, _ = out
        return Sample(image=image, caption=caption, captions=(caption,))
