"""``nclip data``: export a built-in dataset to shards or as image files and caption tables, and summarise
a data source."""

from __future__ import annotations

import collections
import csv
import json
import statistics
from collections.abc import Sequence
from pathlib import Path

from nclip.config import RunConfig
from nclip.data.captions import count_summary
from nclip.data.csv_source import JSONL_SUFFIXES, is_jsonl, load_pair, read_table, row_captions
from nclip.data.hard_negatives import record_negatives, row_negatives
from nclip.data.shards import Bad, ShardWriter, check_shards, decode_captions, expand_shards, iter_records
from nclip.defaults import BUILTIN_SOURCES
from nclip.errors import NclipError


def write_shards(cfg: RunConfig, split: str, count: int, out: str | Path, shard_size: int = 1000,
                 image_format: str = "jpg") -> tuple[int, list[Path], str]:
    """Write the first ``count`` samples of a built-in dataset's ``split`` as img2dataset-style
    shards (``.json`` holds the labels and reference captions). Returns (samples, paths, pattern)."""
    from nclip.data.sources import build_dataset

    if cfg.data.source not in BUILTIN_SOURCES:
        raise NclipError(f"write-shards exports the built-in datasets (synthetic, digits), not {cfg.data.source}")
    if count < 1:
        raise NclipError(f"--count must be >= 1, got {count}")
    data = build_dataset(cfg, split, length=count)
    n = min(count, len(data))
    with ShardWriter(out, shard_size, image_format) as writer:
        for i in range(n):
            s = data[i]
            meta = {"source": cfg.data.source, "split": split, "index": i, "captions": list(s.captions),
                    "labels": {k: int(v) for k, v in s.labels.items()}}
            writer.write(s.image, s.caption, meta)
    return n, writer.paths, writer.pattern()


def write_pairs(dataset: Sequence, out: str | Path, separator: str = "|") -> tuple[Path, Path]:
    """Write a built-in dataset (:class:`nclip.data.synthetic.SyntheticScenes`, digits) as a user's own
    data comes: ``OUT/images/NNNNN.png`` and two tables of the same rows, ``OUT/pairs.jsonl`` (the
    captions and negatives as JSON lists) and ``OUT/pairs.csv`` (each list one cell joined by
    ``separator``). A row holds the image's path (relative to the tables), its reference captions
    (``captions``) and, for scenes made in hard-negative groups (``hard_negative_group`` > 1), its hard
    negatives (``negatives``): the first caption of each other scene of its group, which differs from it
    only in its shapes (a scene with the same shapes gives none; a row left without any holds an empty
    text, an image without negatives). Returns the two tables' paths; an ``OUT`` that holds anything is
    refused, so nothing is overwritten."""
    from PIL import Image

    out = Path(out)
    if len(dataset) == 0:
        raise NclipError("write_pairs: the dataset is empty")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise NclipError(f"{out} already exists and is not an empty folder: write the pairs to a new one")
    (out / "images").mkdir(parents=True, exist_ok=True)
    group = getattr(dataset, "hard_negative_group", 1)
    samples = [dataset[i] for i in range(len(dataset))]
    rows = []
    for i, sample in enumerate(samples):
        path = f"images/{i:05d}.png"
        Image.fromarray(sample.image).save(out / path)
        row = {"filepath": path, "captions": list(sample.captions)}
        if group > 1:
            siblings = samples[i - i % group:i - i % group + group]
            shapes = sorted(sample.mask_classes.tolist())
            negatives = [s.captions[0] for s in siblings if sorted(s.mask_classes.tolist()) != shapes]
            row["negatives"] = negatives or ""
        rows.append(row)
    jsonl, table = out / "pairs.jsonl", out / "pairs.csv"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    with table.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: v if isinstance(v, str) else separator.join(v) for k, v in row.items()})
    return jsonl, table


def shard_urls(source: str) -> list[str]:
    """The shards of a shard pattern or of a directory of ``.tar`` files; one-line error if there are none."""
    path = Path(source)
    if path.is_dir():
        urls = sorted(str(p) for p in path.glob("*.tar"))
        if not urls:
            raise NclipError(f"{source}: no .tar shards in this directory")
        return urls
    return check_shards(expand_shards(source), source)


def inspect_source(source: str, limit: int = 10000, examples: int = 3, csv_image_key: str = "filepath",
                   csv_caption_key: str = "title", caption_separator: str | None = None,
                   json_caption_key: str | None = None, hard_negative_key: str | None = None) -> dict:
    """Summary of a shard pattern / shard directory / CSV-TSV or JSONL file: samples read, bad ones
    by reason, image sizes, captions per image, caption lengths (of every caption), a few examples.
    Reads at most ``limit`` samples. ``caption_separator`` splits a file's caption cells and
    ``json_caption_key`` names the shards' caption field, as ``data.caption_separator`` and
    ``data.json_caption_key`` do (:mod:`nclip.data.captions`); ``hard_negative_key``: the column or
    field of the hard negatives, as ``data.hard_negative_key`` (:mod:`nclip.data.hard_negatives`),
    counted per image."""
    sizes: list[tuple[int, int]] = []
    per_image: list[int] = []
    negatives_per_image: list[int] = []
    chars: list[int] = []
    words: list[int] = []
    reasons: collections.Counter = collections.Counter()
    shown: list[dict] = []
    seen = 0
    summary: dict = {"source": source}

    def take(key: str, image, captions: tuple[str, ...], negatives: tuple[str, ...] = ()) -> None:
        sizes.append((int(image.shape[1]), int(image.shape[0])))
        per_image.append(len(captions))
        negatives_per_image.append(len(negatives))
        chars.extend(len(caption) for caption in captions)
        words.extend(len(caption.split()) for caption in captions)
        if len(shown) < examples:
            shown.append({"key": key, "size": f"{image.shape[1]}x{image.shape[0]}", "caption": captions[0],
                          "captions": len(captions)})

    if source.lower().endswith((".csv", ".tsv", *JSONL_SUFFIXES)):
        columns = {csv_caption_key: "data.csv_caption_key"}
        if hard_negative_key is not None:
            columns[hard_negative_key] = "data.hard_negative_key"
        table = read_table(source, csv_image_key, columns)
        captions = row_captions(source, table, csv_caption_key, caption_separator, hard_negative_key)
        negatives = (row_negatives(table, hard_negative_key, caption_separator, is_jsonl(source))
                     if hard_negative_key is not None else [()] * len(captions))
        summary.update(kind="jsonl" if is_jsonl(source) else "csv", rows=len(table.images))
        for path, caption, negative in zip(table.images[:limit], captions[:limit], negatives[:limit]):
            seen += 1
            out = load_pair(path, caption)
            if isinstance(out, str):
                reasons[out] += 1
            else:
                take(Path(path).name, *out, negative)
    else:
        urls = shard_urls(source)
        summary.update(kind="webdataset", shards=len(urls))
        for url in urls:
            for rec in iter_records(url):
                if seen >= limit:
                    break
                seen += 1
                out = decode_captions(rec, json_caption_key)
                negative: tuple[str, ...] | str = ()
                if hard_negative_key is not None and not isinstance(out, Bad):
                    negative = record_negatives(rec.parts, hard_negative_key)
                if isinstance(out, Bad):
                    reasons[out.reason.split(":")[0]] += 1
                elif isinstance(negative, str):
                    reasons[negative] += 1
                else:
                    take(rec.key, out[0], out[1], negative)
            if seen >= limit:
                break
    good = len(sizes)
    summary.update(read=seen, good=good, bad=seen - good, bad_reasons=dict(reasons.most_common()),
                   truncated=seen >= limit)
    if good:
        ws, hs = [w for w, _ in sizes], [h for _, h in sizes]
        summary["image_width"] = {"min": min(ws), "median": statistics.median(ws), "max": max(ws)}
        summary["image_height"] = {"min": min(hs), "median": statistics.median(hs), "max": max(hs)}
        summary["captions_per_image"] = count_summary(per_image)
        if hard_negative_key is not None:
            summary["negatives_per_image"] = count_summary(negatives_per_image)
        summary["caption_chars"] = {"min": min(chars), "mean": round(statistics.fmean(chars), 1), "max": max(chars)}
        summary["caption_words"] = {"min": min(words), "mean": round(statistics.fmean(words), 1), "max": max(words)}
    summary["examples"] = shown
    return summary


def format_summary(s: dict) -> str:
    lines = [f"source        {s['source']} ({s['kind']})"]
    if "shards" in s:
        lines.append(f"shards        {s['shards']}")
    if "rows" in s:
        lines.append(f"rows          {s['rows']}")
    more = " (stopped at --limit)" if s["truncated"] else ""
    lines.append(f"samples read  {s['read']}{more}: {s['good']} good, {s['bad']} bad")
    for reason, n in s["bad_reasons"].items():
        lines.append(f"  bad: {n} × {reason}")
    for key, label in (("image_width", "width"), ("image_height", "height"), ("captions_per_image", "captions/img"),
                       ("negatives_per_image", "negatives/img"), ("caption_chars", "caption chars"),
                       ("caption_words", "caption words")):
        if key in s:
            v = s[key]
            mid = f"median {v['median']}" if "median" in v else f"mean {v['mean']}"
            lines.append(f"{label:<14}min {v['min']}, {mid}, max {v['max']}")
    for ex in s["examples"]:
        more = f" (+{ex['captions'] - 1} more)" if ex["captions"] > 1 else ""
        lines.append(f"  {ex['key']}  {ex['size']}  {ex['caption']!r}{more}")
    return "\n".join(lines)
