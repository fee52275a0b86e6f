"""JSON and the user's text files in and out with nclip's conventions: a missing or bad file is a
one-line NclipError (:func:`read_text`, :func:`read_json`), non-finite floats (which JSON cannot
hold) are replaced on the way out, JSONL logs have one reader and one truncation, which skip
damaged lines (:func:`read_jsonl`), and a write that fails (a full disk) is one line that names
the path (:func:`writing`)."""

from __future__ import annotations

import errno
import json
import math
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

from nclip.errors import NclipError


def jsonable(x: Any, nonfinite: Callable[[float], Any]) -> Any:
    """``x`` with dict keys as strings, tuples as lists, and each NaN/inf float ``f`` replaced by
    ``nonfinite(f)`` (for example ``str`` for "nan", or ``lambda f: None`` for null)."""
    if isinstance(x, dict):
        return {str(k): jsonable(v, nonfinite) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v, nonfinite) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return nonfinite(x)
    return x


def read_text(path: str | Path, what: str) -> tuple[Path, str]:
    """(the expanded path, its UTF-8 text) of a user's file; ``what`` names it in the one-line
    error for a missing file ("hierarchy file", ...); text that is not UTF-8 is an error too."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise NclipError(f"{what} not found: {path}")
    try:
        return path, path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise NclipError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def read_json(path: Path) -> Any:
    """The parsed contents of a JSON file; invalid JSON (a truncated file among it) or text that is
    not UTF-8 is an NclipError naming file and line."""
    return parse_json(*read_text(path, "JSON file"))


def parse_yaml(path: str | Path, text: str) -> Any:
    """``text`` (read from ``path``, or a preset's name) parsed as YAML; invalid YAML is an
    NclipError naming the file, the problem and where it is (line and column, from 1)."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise NclipError(f"cannot parse {path}: {what}{where}") from None


def parse_json(path: Path, text: str) -> Any:
    """``text`` (read from ``path``) parsed as JSON; invalid JSON is an NclipError naming file and
    line."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise NclipError(f"{path}: invalid JSON ({e.msg}, line {e.lineno})") from None


def check_writable_dir(path: str | Path, option: str) -> None:
    """Refuse, as a one-line NclipError naming ``option`` (``--out``), a directory that cannot be
    created or written: one below a regular file, or whose nearest existing folder denies writing.
    Checked before any work, so a run fails in its first second rather than at its first write."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        return  # the caller says what a file in its place means ("is a file, not a run directory")
    existing = path
    while not existing.exists():
        if existing.parent == existing:
            return
        existing = existing.parent
    if not existing.is_dir():
        raise NclipError(f"{option} {path}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise NclipError(f"{option} {path}: cannot write into {existing} (permission denied)")


class WriteFailed(NclipError):
    """A write that failed for want of space, quota or a working disk: one line naming the path;
    a caller may add what was kept (the trainer: the last good checkpoint)."""


@contextmanager
def writing(path: str | Path):
    """Turn a failed write inside the block into a one-line :class:`WriteFailed` naming ``path``:
    any OSError (ENOSPC, EDQUOT, EIO, ...), torch.save's "PytorchStreamWriter failed writing" and
    safetensors' serialisation errors, which wrap the OSError in their own types. A full disk is
    said as such even where the wrapping lost the errno."""
    try:
        yield
    except NclipError:
        raise
    except Exception as e:
        if not (isinstance(e, OSError) or type(e).__name__ == "SafetensorError"
                or (isinstance(e, RuntimeError) and "PytorchStreamWriter" in str(e))):
            raise
        reason = e.strerror if isinstance(e, OSError) and e.strerror else (str(e).strip().splitlines() or [""])[0]
        if not (isinstance(e, OSError) and e.errno) and _disk_full(Path(path)):
            reason = f"{os.strerror(errno.ENOSPC)} ({reason[:120]})"
        raise WriteFailed(f"cannot write {path}: {reason[:200]}") from None


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it, renamed over it: a reader (or
    a failure half-way) never sees half a file, and the old one stays until the new one is whole.
    A failed write is one line naming ``path`` (:func:`writing`)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with writing(path):
        try:
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


def _disk_full(path: Path) -> bool:
    while not path.exists() and path.parent != path:
        path = path.parent
    try:
        return os.statvfs(path).f_bavail == 0
    except OSError:
        return False


def _jsonl_rows(path: Path) -> list[tuple[str, dict]]:
    """(line, row) for every line of ``path`` that decodes to a JSON object; see :func:`read_jsonl`."""
    if not path.is_file():
        return []
    rows = []
    for raw in path.read_bytes().splitlines():
        try:
            line = raw.decode("utf-8")
            row = json.loads(line)
        except ValueError:  # blank, torn by a crash, or not UTF-8 / not JSON (UnicodeDecodeError is one)
            continue
        if isinstance(row, dict):
            rows.append((line, row))
    return rows


def read_jsonl(path: str | Path) -> list[dict]:
    """The rows of a JSONL log (metrics.jsonl, episodes.jsonl): every line that decodes to a JSON
    object, in file order.

    Everything else is skipped, never an error, wherever it is in the file: blank lines; a line
    torn by a crash in the middle of writing it (the last line, which is also what a reader running
    beside the writer may see); a line that is not UTF-8 or not JSON; a JSON value that is not an
    object. A log is evidence of what a run did, and one damaged line must not make the rest
    unreadable. A file that does not exist (yet) has no rows. ``NaN``/``Infinity`` read as floats.
    """
    return [row for _, row in _jsonl_rows(Path(path))]


def jsonl_objects(lines, path: str | Path):
    """(line number, object) of every non-blank line of a JSONL *data* file (``lines``: its open text
    file), strictly: unlike a log (:func:`read_jsonl`), a line that is not a JSON object is a one-line
    error naming the file and line, since skipping it would silently drop a sample."""
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise NclipError(f"{path} line {n}: invalid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise NclipError(f"{path} line {n}: expected a JSON object, got a {type(row).__name__}")
        yield n, row


def truncate_jsonl(path: str | Path, keep: Callable[[dict], bool]) -> None:
    """Rewrite a JSONL log with only the rows for which ``keep(row)`` is true, each line kept as it
    was written, and without the lines :func:`read_jsonl` skips (a torn last line among them).

    The new file replaces the old atomically (written beside it, then renamed), so a crash leaves
    one or the other. A missing file stays missing. Used on resume, e.g. ``keep=lambda row:
    row.get("step", math.inf) <= step`` to drop what was logged after the checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        return
    kept = [line for line, row in _jsonl_rows(path) if keep(row)]
    write_text_atomic(path, "".join(line + "\n" for line in kept))
