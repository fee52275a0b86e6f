"""``nclip data dedup``: hash two sources, find the target images that duplicate a reference image
(:mod:`nclip.data.dedup`), and write what was found.

Files in ``--out DIR``:

* ``duplicates.json``: a list of {"target", "reference", "distance"} (identifiers as
  :mod:`nclip.data.image_sources` names them), sorted by target; the exclusion list that
  :func:`nclip.data.dedup.load_exclusions` reads;
* ``duplicates.html``: counts and side-by-side thumbnails of the first ``MAX_SHOWN`` pairs
  (base64-embedded PNGs: one self-contained file);
* with ``--write-filtered``: the target without its duplicates, ``filtered.csv`` (the CSV's own
  rows and columns) for a CSV target, else ``filtered.txt`` (one identifier per line).
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import os
from collections.abc import Callable
from pathlib import Path

from PIL import Image

from nclip.data.dedup import Hashed, find_duplicates, hash_images
from nclip.data.image_sources import ImageSource, open_source
from nclip.errors import NclipError

MAX_SHOWN = 200
THUMB = 96  # longest side of a thumbnail, pixels


def run_dedup(reference: str, target: str, max_distance: int, out: str | Path | None, config: Callable[[str], object],
              write_filtered: bool = False, csv_image_key: str = "filepath", workers: int | None = None,
              fast_jpeg: bool = False) -> str:
    """Run the whole command; returns the one-line summary."""
    if isinstance(max_distance, bool) or not isinstance(max_distance, int) or not 0 <= max_distance <= 64:
        raise NclipError(f"--max-distance must be an integer in [0, 64], got {max_distance}")
    if write_filtered and out is None:
        raise NclipError("--write-filtered needs --out DIR")
    workers = workers or max(1, min(4, os.cpu_count() or 1))
    sources = [open_source(s, config, csv_image_key) for s in (reference, target)]
    hashed = []
    for role, src in zip(("reference", "target"), sources):
        h = hash_images(src, workers, fast_jpeg)
        h.bad += src.bad
        if not h.ids:
            raise NclipError(f"{role} {src.spec}: no readable images"
                             + (f" ({len(h.bad)} unreadable, e.g. {h.bad[0][0]}: {h.bad[0][1]})" if h.bad else ""))
        hashed.append(h)
    ref, tgt = hashed
    pairs = find_duplicates(ref.codes, tgt.codes, max_distance)
    rows = [{"target": tgt.ids[t], "reference": ref.ids[r], "distance": d} for t, r, d in pairs]
    dup_targets = {row["target"] for row in rows}
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "duplicates.json").write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
        counts = {"reference images": len(ref.ids), "target images": len(tgt.ids),
                  "unreadable (reference, target)": f"{len(ref.bad)}, {len(tgt.bad)}",
                  "max Hamming distance": max_distance, "duplicate pairs": len(rows),
                  "target images with a duplicate": len(dup_targets)}
        _write_html(out / "duplicates.html", rows, sources, counts)
        if write_filtered:
            _write_filtered(out, sources[1], tgt, dup_targets)
    n_hashed = len(ref.ids) + len(tgt.ids) + len(ref.bad) + len(tgt.bad)
    seconds = ref.seconds + tgt.seconds
    rate = n_hashed / seconds if seconds > 0 else float("inf")
    return (f"dedup: {len(ref.ids)} reference, {len(tgt.ids)} target images; {len(dup_targets)} target images "
            f"duplicate a reference image at Hamming distance <= {max_distance} ({len(rows)} pairs); hashed "
            f"{n_hashed} images at {rate:.0f} images/s ({workers} thread{'s' * (workers != 1)})"
            + (f"; wrote {out}" if out is not None else ""))


def _thumb(image: Image.Image | None) -> str:
    if image is None:
        return "<i>unavailable</i>"
    im = image.convert("RGB")
    im.thumbnail((THUMB, THUMB))
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return f'<img src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def _write_html(path: Path, rows: list[dict], sources: list[ImageSource], counts: dict) -> None:
    shown = rows[:MAX_SHOWN]
    images = [src.open_many({row[role] for row in shown}) if shown else {}
              for src, role in zip(sources, ("reference", "target"))]
    esc = html.escape
    lines = ["<!doctype html><meta charset='utf-8'><title>nclip dedup</title>",
             "<style>body{font-family:sans-serif}td{padding:4px;vertical-align:top;font-size:12px}"
             "img{image-rendering:pixelated}</style>",
             f"<h1>Duplicates of {esc(sources[0].spec)} in {esc(sources[1].spec)}</h1><table>"]
    lines += [f"<tr><td>{esc(k)}</td><td>{esc(str(v))}</td></tr>" for k, v in counts.items()]
    lines.append(f"</table><p>showing {len(shown)} of {len(rows)} pairs</p><table>"
                 "<tr><th>target</th><th>reference</th><th>distance</th></tr>")
    for row in shown:
        lines.append(f"<tr><td>{_thumb(images[1].get(row['target']))}<br>{esc(row['target'])}</td>"
                     f"<td>{_thumb(images[0].get(row['reference']))}<br>{esc(row['reference'])}</td>"
                     f"<td>{row['distance']}</td></tr>")
    lines.append("</table>")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _write_filtered(out: Path, source: ImageSource, hashed: Hashed, drop: set[str]) -> None:
    if source.csv_rows is None:
        kept = [k for k in hashed.ids if k not in drop] + [k for k, _ in hashed.bad]
        (out / "filtered.txt").write_text("".join(f"{k}\n" for k in kept), encoding="utf-8")
        return
    from nclip.data.csv_source import read_rows

    file, key = source.csv_rows
    images, _ = read_rows(file, key, key)  # the resolved path of each data row, in file order
    with open(file, newline="", encoding="utf-8") as f:
        first = f.readline()
        f.seek(0)
        delimiter = "\t" if file.lower().endswith(".tsv") or "\t" in first else ","
        table = [row for row in csv.reader(f, delimiter=delimiter) if row]  # DictReader skips empty rows too
    suffix = ".tsv" if delimiter == "\t" else ".csv"
    with open(out / f"filtered{suffix}", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, delimiter=delimiter)
        writer.writerow(table[0])
        writer.writerows(row for row, image in zip(table[1:], images) if image not in drop)
