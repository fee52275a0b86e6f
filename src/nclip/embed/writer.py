"""``nclip embed``: a data spec's zero-shot embeddings written shard by shard (see
:mod:`nclip.embed.manifest` for the files), resumable after a kill, under the directory lock.

Loading overlaps encoding: :func:`nclip.eval.features._decoded_batches` (the evaluation's streamed
extraction) decodes the next batch on a thread pool while the model encodes this one. Embeddings are
computed in float32 and stored in float16; the Faiss index holds the stored vectors ℓ2-normalised,
so its inner product is their cosine.
"""

from __future__ import annotations

import json
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np

from nclip.embed import manifest as mf
from nclip.errors import NclipError
from nclip.overwrite import EMBED, check_output_folder

DEFAULT_SHARD_SIZE, DEFAULT_BATCH_SIZE = mf.DEFAULT_SHARD_SIZE, mf.DEFAULT_BATCH_SIZE


def embed(spec: str, checkpoint: str | Path, out: str | Path, *, arch: str | None = None,
          batch_size: int = DEFAULT_BATCH_SIZE, shard_size: int = DEFAULT_SHARD_SIZE, device: str | None = None,
          samples: int = 1000, seed: int = 0, image_key: str | None = None, caption_key: str | None = None,
          force: bool = False, progress: bool = True, log: Callable[[str], None] | None = None) -> dict:
    """Embed the rows of ``spec`` (:func:`nclip.embed.sources.open_rows`) with the model at
    ``checkpoint`` (anything ``nclip.load`` takes; ``arch``: an open_clip state dict's config) into
    ``out``; returns the manifest. The same call after a kill continues after the last finished
    shard; ``out`` holding other files or another model's embeddings is refused unless ``force``, and with
    ``force`` an ``out`` that is, holds or lies in a run, a checkpoint or another command's output
    (:func:`nclip.overwrite.check_output_folder`)."""
    from nclip.embed import model as embed_model
    from nclip.embed.sources import open_rows
    from nclip.runlock import DirLock

    if batch_size < 1 or shard_size < 1:
        raise NclipError(f"--batch-size and --shard-size must be >= 1, got {batch_size} and {shard_size}")
    out = Path(out).expanduser()
    if force:  # before the model loads: a refusal is quick
        check_output_folder(out, "--out", EMBED)
    ck = embed_model.resolve(checkpoint, arch)
    cfg = ck.cfg
    rows = open_rows(spec, image_size=cfg.data.image_size, max_objects=cfg.data.max_objects, seed=seed,
                     samples=samples, image_key=image_key, caption_key=caption_key,
                     run_keys=cfg.data.caption_keys())
    model = embed_model.describe(ck)
    score, _, embedding = embed_model.zero_shot_space(cfg)
    settings = {"data": rows.identity, "embedding": embedding, "image_size": cfg.data.image_size,
                "batch_size": batch_size, "shard_size": shard_size, "dtype": "float16", "compute_dtype": "float32",
                "texts": rows.captions and score is not None}
    with DirLock(out, "nclip embed"):
        doc = mf.resume_point(out, model, settings, force)  # before the model loads: a refusal is quick
        if doc is not None and doc.get("complete"):
            (log or _stderr)(f"embed: {out} already holds these embeddings ({doc['rows']} rows); nothing to do")
            shutil.rmtree(out / mf.PARTS, ignore_errors=True)  # left by a kill just after the manifest
            return doc
        doc = doc or {"format": mf.FORMAT, "model": model, "settings": settings, "shards": [], "rows": 0,
                      "position": 0, "complete": False}
        out.mkdir(parents=True, exist_ok=True)
        write_shards(doc, out, rows, embed_model.Encoder.load(ck, device), progress)
        return _finish(doc, out, rows)


def write_shards(doc: dict, out: Path, rows, encoder, progress: bool) -> None:
    """Encode and write every shard after the manifest's last one, updating the manifest after each."""
    from tqdm.auto import tqdm

    from nclip.eval.features import _DECODE_THREADS, _decoded_batches

    settings = doc["settings"]
    total = rows.total
    bar = tqdm(total=total, initial=doc["rows"], unit="img", desc="embed", disable=not progress, file=sys.stderr,
               dynamic_ncols=True)
    label_kind = next(iter(rows.label_names), None)
    with ThreadPoolExecutor(max_workers=_DECODE_THREADS) as pool, bar:
        for samples, where in rows.chunks(doc["position"], settings["shard_size"]):
            n, first = len(doc["shards"]), doc["rows"]
            parts, meta = [], []
            for start, pixels, batch in _decoded_batches(pool, samples, encoder.image_size, settings["batch_size"],
                                                         encoder.resize):
                parts.append(encoder.images(pixels))
                for i, s in enumerate(batch, start):
                    meta.append(_row(first + i, where[i], s, samples.splits[i], label_kind, rows))
                bar.update(len(batch))
            shard = {"images": mf.shard_name("images", n), "rows": len(meta)}
            _save(out / shard["images"], np.concatenate([p.numpy() for p in parts]))
            if settings["texts"]:
                shard["texts"] = mf.shard_name("texts", n)
                _save(out / shard["texts"], encoder.texts([m["caption"] for m in meta], settings["batch_size"]).numpy())
            (out / mf.PARTS).mkdir(exist_ok=True)
            mf.atomic_write(out / mf.PARTS / mf.shard_name("meta", n),
                            lambda tmp: tmp.write_text("".join(json.dumps(m) + "\n" for m in meta)))
            doc["shards"].append(shard)
            doc["rows"] += len(meta)
            doc["position"] = rows.position()
            mf.write_manifest(out, doc)  # the shard counts as finished from here on


def _row(row: int, where: str | None, sample, split: str, label_kind: str | None, rows) -> dict:
    """A metadata line: row id, path (where known), caption (data with captions), label name, split."""
    label = None
    if label_kind is not None and label_kind in sample.labels:
        label = rows.label_names[label_kind][sample.labels[label_kind]]
    return {"row": row, "path": where, "caption": sample.caption if rows.captions else None, "label": label,
            "split": split or None}


def _save(path: Path, array: np.ndarray) -> None:
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as fh:
            np.save(fh, array.astype(np.float16))

    mf.atomic_write(path, write)


def _finish(doc: dict, out: Path, rows) -> dict:
    """The one metadata file, the Faiss index and the completed manifest, from the finished shards."""
    from nclip.embed.vectors import build_faiss

    if doc["rows"] == 0:
        raise NclipError(f"{rows.spec}: no rows to embed")
    parts = [out / mf.PARTS / mf.shard_name("meta", n) for n in range(len(doc["shards"]))]
    mf.atomic_write(out / mf.METADATA, lambda tmp: tmp.write_text("".join(p.read_text() for p in parts)))
    index = build_faiss(out, doc)
    import faiss

    mf.atomic_write(out / mf.INDEX, lambda tmp: faiss.write_index(index, str(tmp)))
    doc.update(complete=True, dim=int(index.d), metadata=mf.METADATA,
               index={"file": mf.INDEX, "kind": "IndexFlatIP", "metric": "inner product of l2-normalised vectors"},
               skipped=rows.skipped[:100], skipped_count=len(rows.skipped))
    mf.write_manifest(out, doc)
    shutil.rmtree(out / mf.PARTS, ignore_errors=True)
    return doc


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
