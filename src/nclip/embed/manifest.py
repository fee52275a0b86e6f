"""The files of an embedding directory and its manifest: what a rerun must match to resume, and
what ``nclip search`` / :class:`nclip.Index` read.

    DIR/manifest.json          model (path, sha256 of its weights, objective), settings, finished shards
    DIR/images-00000.npy ...   float16 [rows, D] image embeddings, one file per shard
    DIR/texts-00000.npy ...    float16 [rows, D] caption embeddings (data with captions), row for row
    DIR/metadata.jsonl         one line per row: row, path, caption, label, split (written at the end)
    DIR/index.faiss            inner product over the ℓ2-normalised image embeddings (written at the end)
    DIR/.parts/                each finished shard's metadata until the end

Every file is written to a temporary name and renamed into place, and the manifest lists a shard
only once its files are in place: a killed run leaves finished shards and a manifest that names
them, and the same command continues after the last one.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from pathlib import Path
from typing import Callable

from nclip.errors import NclipError
from nclip.jsonio import read_json, writing
from nclip.overwrite import EMBED
from nclip.runlock import LOCK_NAME

FORMAT = "nclip-embed/1"
DEFAULT_SHARD_SIZE = 10_000  # rows per .npy file
DEFAULT_BATCH_SIZE = 64
MANIFEST, METADATA, INDEX, PARTS = "manifest.json", "metadata.jsonl", "index.faiss", ".parts"
assert EMBED.markers == (MANIFEST,)  # how nclip.overwrite tells an embedding's folder


def shard_name(kind: str, n: int) -> str:
    """``images-00003.npy`` / ``texts-00003.npy``; ``meta-00003.jsonl`` under :data:`PARTS`."""
    return f"{kind}-{n:05d}.{'jsonl' if kind == 'meta' else 'npy'}"


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` then rename ``tmp`` to ``path``: the path holds the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    with writing(path):
        write(tmp)
        os.replace(tmp, path)


def write_manifest(out: Path, doc: dict) -> None:
    atomic_write(out / MANIFEST, lambda tmp: tmp.write_text(json.dumps(doc, indent=2) + "\n"))


def read_manifest(directory: str | Path) -> dict:
    """The manifest of an embedding directory; one line if there is none."""
    path = Path(directory).expanduser() / MANIFEST
    if not path.is_file():
        raise NclipError(f"{path.parent} holds no embeddings ({MANIFEST} not found; write them with nclip embed)")
    doc = read_json(path)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise NclipError(f"{path}: not an nclip embed manifest (format {FORMAT!r})")
    return doc


def damaged(directory: str | Path, doc: dict, name: str, what: str) -> NclipError:
    """The one-line error for a file of an embedding directory that is not as ``nclip embed`` wrote
    it: the file, what is wrong with it, and the command that writes the directory again."""
    rebuild = rebuild_command(directory, doc)
    return NclipError(f"{Path(directory) / name}: {what}; rebuild the directory with: {rebuild}")


def rebuild_command(directory: str | Path, doc: dict) -> str:
    """The ``nclip embed ... --force`` command that writes ``directory`` again from what its
    manifest says (SPEC or CHECKPOINT where the manifest itself is damaged)."""
    settings, model = _dict(doc.get("settings")), _dict(doc.get("model"))
    spec, path = _dict(settings.get("data")).get("spec"), model.get("path")
    words = ["nclip", "embed", spec if isinstance(spec, str) else "SPEC",
             "--checkpoint", path if isinstance(path, str) else "CHECKPOINT"]
    if isinstance(model.get("arch"), str):
        words += ["--arch", model["arch"]]
    for flag, key, default in (("--shard-size", "shard_size", DEFAULT_SHARD_SIZE),
                               ("--batch-size", "batch_size", DEFAULT_BATCH_SIZE)):
        if isinstance(settings.get(key), int) and settings[key] != default:
            words += [flag, str(settings[key])]
    return shlex.join([*words, "--out", str(directory), "--force"])


def _dict(x) -> dict:
    return x if isinstance(x, dict) else {}


def check_finished(directory: Path, doc: dict) -> None:
    """One line, naming the manifest, when a finished manifest lacks a field that search reads."""
    model, shards = _dict(doc.get("model")), doc.get("shards")
    fields_ok = {
        "rows": _count(doc.get("rows")),
        "dim": _count(doc.get("dim")) and doc["dim"] > 0,
        "model.path": isinstance(model.get("path"), str),
        "model.sha256": isinstance(model.get("sha256"), str),
        "shards": isinstance(shards, list) and all(
            isinstance(s, dict) and isinstance(s.get("images"), str) and _count(s.get("rows")) for s in shards),
    }
    bad = [key for key, ok in fields_ok.items() if not ok]
    if bad:
        raise damaged(directory, doc, MANIFEST, f"its {bad[0]} field is missing or malformed")
    if sum(s["rows"] for s in shards) != doc["rows"]:
        raise damaged(directory, doc, MANIFEST, f"its shards hold {sum(s['rows'] for s in shards)} rows, "
                      f"its rows field says {doc['rows']}")


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def read_metadata(directory: Path, doc: dict) -> list[dict]:
    """The rows of ``metadata.jsonl``, one JSON object per line, as many as the manifest counts;
    one line naming the file and the way to rebuild it otherwise (truncated, malformed)."""
    path = directory / METADATA
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise damaged(directory, doc, METADATA, "not found") from None
    except UnicodeDecodeError as e:
        raise damaged(directory, doc, METADATA, f"not UTF-8 text (byte {e.start})") from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, dict):
            raise damaged(directory, doc, METADATA, f"line {n} is not a JSON object")
        rows.append(row)
    if len(rows) != doc["rows"]:
        raise damaged(directory, doc, METADATA, f"holds {len(rows)} rows, the manifest {doc['rows']} (truncated?)")
    return rows


def resume_point(out: Path, model: dict, settings: dict, force: bool) -> dict | None:
    """The manifest to continue from: None to start afresh (an empty or missing DIR, or ``force``,
    which first removes the embedding files there, this embedding's own too: the way to rebuild a
    damaged directory). A DIR that holds other files, or embeddings of another model or other
    settings, is refused in one line unless ``force``."""
    if not out.is_dir():
        return None
    try:
        old = read_manifest(out) if (out / MANIFEST).exists() else None
    except NclipError:
        old = None
    same = old is not None and old.get("model", {}).get("sha256") == model["sha256"] \
        and old.get("settings") == json.loads(json.dumps(settings))
    if same and not force:
        return old
    others = sorted(p.name for p in out.iterdir() if p.name != LOCK_NAME)
    if not others:
        return None
    if not force:
        if old is None:
            raise NclipError(f"--out {out} is not empty and holds no embeddings ({others[0]}); choose an empty "
                             "--out, or pass --force to write embeddings beside its files")
        what = "another model" if old.get("model", {}).get("sha256") != model["sha256"] else "other settings"
        raise NclipError(f"--out {out} holds embeddings of {what} ({_differs(old, model, settings)}); choose another "
                         "--out, or pass --force to replace them")
    clear(out)
    return None


def _differs(old: dict, model: dict, settings: dict) -> str:
    if old.get("model", {}).get("sha256") != model["sha256"]:
        return f"{old.get('model', {}).get('path')}, not {model['path']}"
    theirs = old.get("settings", {})
    mine = json.loads(json.dumps(settings))
    key = next((k for k in sorted(set(theirs) | set(mine)) if theirs.get(k) != mine.get(k)), "?")
    return f"{key}: {json.dumps(theirs.get(key))[:60]}, not {json.dumps(mine.get(key))[:60]}"


def clear(out: Path) -> None:
    """Remove the embedding files of ``out`` (never anything else the directory holds)."""
    for pattern in ("images-*.npy", "texts-*.npy", MANIFEST, METADATA, INDEX, ".*.tmp"):
        for path in out.glob(pattern):
            path.unlink()
    shutil.rmtree(out / PARTS, ignore_errors=True)
