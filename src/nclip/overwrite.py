"""What a command may write over (docs/runs.md, "What --force replaces").

``nclip export`` and ``nclip merge`` replace their output folder whole; ``nclip eval``, ``embed``,
``finetune`` and ``sweep`` with ``--force`` write over what their ``--out`` holds. Neither may reach a
training run, a checkpoint or another command's output: :func:`check_output_folder` refuses, in one
line, an output folder that is one, holds one anywhere below it, or lies inside a run's own files
or a checkpoint. A folder beside a run's files (``RUN/eval``, ``RUN/embed``) is an output folder
like any other.

A folder is told by the names at its top: a run by the trainer's files, a checkpoint by its
``step_N`` name or ``state.pt``, a model by its config and weights, a command's output by the file
that command always writes there (:data:`OUTPUTS`). Nothing is read but folder listings.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from nclip.errors import NclipError

# Everything the trainer writes into a run directory, in the order `nclip train --force` removes them
# (nclip.train.rundir): checkpoints first, so that a --force stopped half-way leaves nothing to resume from.
RUN_FILES = ("checkpoints", "metrics.jsonl", "episodes.jsonl", "eval.json", "model", "model-raw", "config.yaml")
_RUN_MARKERS = frozenset(RUN_FILES) - {"model", "model-raw"}  # a fine-tuning's folder has a model/ too
_CHECKPOINT_NAME = re.compile(r"step_[0-9]+")  # RUN/checkpoints/step_N (nclip.models.io.STEP_PREFIX)
_CHECKPOINT_STATE = "state.pt"
# a model directory: nclip's (RUN/model), a transformers one, an open_clip one
_MODEL_FILES = (("config.json", "model.safetensors"), ("config.json", "pytorch_model.bin"), ("open_clip_config.json",))
WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt", ".onnx")  # a checkpoint in one file
MAX_FOLDERS = 10_000  # a larger tree is not searched: the command refuses it


@dataclass(frozen=True)
class Output:
    """What one command writes into its output folder."""

    command: str
    own: str  # what --force may replace, for the error line
    markers: tuple[str, ...]  # a folder with one of these at its top holds this command's output
    parts: tuple[str, ...] = ()  # the command's other files and folders there
    is_model: bool = False  # the folder is also a model directory (weights and config)


EXPORT = Output("nclip export", "an earlier export", ("nclip_export.json",), ("tokenizer",), is_model=True)
MERGE = Output("nclip merge", "an earlier merge", ("merge.json",), ("tokenizer",), is_model=True)
FINETUNE = Output("nclip finetune", "its own fine-tuning run", ("finetune.json",),
                  ("sweep", "model", "results.json", "report.html"))
EVAL = Output("nclip eval", "an earlier evaluation", ("results.json", "report.html"))
EMBED = Output("nclip embed", "earlier embeddings", ("manifest.json",))
SWEEP = Output("nclip sweep", "its own sweep", ("sweep.json",), ("runs", "table.md", "table.csv", "curves.png"))
# in the order a folder is told apart: the results.json of a fine-tuning is not an evaluation's
OUTPUTS = (FINETUNE, SWEEP, EMBED, MERGE, EXPORT, EVAL)

RUN, CHECKPOINT, MODEL = "a training run", "a training checkpoint", "a model"


def check_output_folder(out: str | Path, option: str, writer: Output) -> None:
    """Refuse in one line an ``out`` (named ``option`` in the line) that ``writer`` must not write
    over: one that is, holds or lies inside a training run or a checkpoint (a run's own files:
    ``RUN/checkpoints``, ``RUN/model``; not ``RUN/eval``), or that holds another command's output."""
    out = Path(out).expanduser()
    path = Path(os.path.abspath(out)).resolve()  # a symlink to a run is the run
    rule = (f"{writer.command} --force replaces only {writer.own}, never a training run, a checkpoint or another "
            f"command's output: choose another {option}")
    if inside := _inside(path):
        raise NclipError(f"{option} {out} {inside}; {rule}")
    if not path.is_dir():
        return
    found = [what for what, by in _what(path, _names(path)) if by is not writer]
    if found:
        raise NclipError(f"{option} {out} is {found[0]}; {rule}")
    if held := _held(path, writer):
        what, where = held
        raise NclipError(f"{option} {out} holds {what} ({where}); {rule}")


def _names(folder: Path) -> set[str]:
    try:
        return set(os.listdir(folder))
    except OSError:
        return set()


def _what(folder: Path, names: set[str]) -> list[tuple[str, Output | None]]:
    """What nclip wrote at the top of ``folder`` (whose entries are ``names``): descriptions, each with
    the command output it is (None: a run, a checkpoint, a model)."""
    found: list[tuple[str, Output | None]] = []
    if names & _RUN_MARKERS:
        found.append((RUN, None))
    named = _CHECKPOINT_NAME.fullmatch(folder.name) and (folder.parent.name == "checkpoints"
                                                          or "model.safetensors" in names)
    if named or _CHECKPOINT_STATE in names:
        found.append((CHECKPOINT, None))
    claimed: set[str] = set()
    outputs = []
    for output in OUTPUTS:
        if (set(output.markers) & names) - claimed:
            outputs.append(output)
            claimed |= set(output.markers) | set(output.parts)
    found += [(f"{output.command}'s output", output) for output in outputs]
    if not any(o.is_model for o in outputs) and any(set(files) <= names for files in _MODEL_FILES):
        found.append((MODEL, None))
    return found


def _inside(path: Path) -> str | None:
    """"lies inside" the checkpoint or model, or "is" or "lies inside" the run's own file (its
    ``checkpoints/``, ``model/``), that holds ``path``; None if none."""
    for child, folder in zip((path, *path.parents), path.parents):
        kinds = {what for what, _ in _what(folder, _names(folder))}
        if CHECKPOINT in kinds or MODEL in kinds:
            return f"lies inside {CHECKPOINT if CHECKPOINT in kinds else MODEL} {folder}"
        if RUN in kinds and child.name in RUN_FILES:
            return f"{'is' if child == path else 'lies inside'} the {child.name} of {RUN} {folder}"
    return None


def _held(path: Path, writer: Output) -> tuple[str, Path] | None:
    """(what, where) of the first run, checkpoint, model, checkpoint file or other command's output
    below ``path``, whose own top-level files and ``writer.parts`` are ``writer``'s own when ``path``
    holds ``writer``'s output already."""
    mine = any(by is writer for _, by in _what(path, _names(path)))
    skip = set(writer.parts) if mine else set()
    folders, seen = [path], 0
    while folders:
        folder = folders.pop()
        seen += 1
        if seen > MAX_FOLDERS:
            return f"more than {MAX_FOLDERS} folders, too many to check", path
        if folder != path and (kinds := _what(folder, _names(folder))):
            return kinds[0][0], folder
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            if entry.name.startswith(".") or (folder == path and entry.name in skip):
                continue  # locks, temporaries, caches; the writer's own parts
            if entry.is_dir(follow_symlinks=False):
                folders.append(Path(entry.path))
            elif entry.name.endswith(WEIGHT_SUFFIXES) and not (folder == path and mine):
                return "a checkpoint file", Path(entry.path)
    return None
