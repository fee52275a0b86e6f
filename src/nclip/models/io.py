"""Model files: safetensors weights + the resolved run config as JSON. Nothing is unpickled.

Every weights file nclip writes (a model directory's, a training checkpoint's, a merge's) carries
:data:`MODEL_FORMAT` in its safetensors header, and :func:`read_weights` refuses another version in
one line (the weights' names change with the model's layout: an older file would not load, or load
half). The names of training checkpoint directories, ``step_XXXXXXXX``, are read here too
(:func:`checkpoint_step`): the trainer writes them, evaluation and the CLI find them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from nclip import fileperm
from nclip.config import RunConfig, validate
from nclip.data import clip_bpe
from nclip.data.tokenization import SENTENCEPIECE_FILE
from nclip.errors import NclipError
from nclip.jsonio import read_json

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
TOKENIZER_DIR = "tokenizer"  # a copy of model.text.tokenizer (model.init), so the directory stands alone
# the first: a tokenizers file; the last: SigLIP's SentencePiece model (with its tokenizer_config.json)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", SENTENCEPIECE_FILE)
# the layout of the weights' names; 2: the heads as modules, keyed by head name. A file without the
# header entry is format 1 (every file written before the version was kept)
MODEL_FORMAT = 2
FORMAT_KEY = "nclip_model_format"
STEP_PREFIX = "step_"  # a training checkpoint's directory: RUN/checkpoints/step_XXXXXXXX
_STEP_NAME = re.compile(rf"{STEP_PREFIX}([0-9]+)")


class FormatMismatch(NclipError):
    """A file in another nclip format version than this nclip reads: not damaged, refused as it is."""


def check_format(path: Path, found: int, needed: int, what: str) -> None:
    """One line, naming ``path`` and both versions, unless ``found`` is ``needed``."""
    if found != needed:
        raise FormatMismatch(f"{path} is {what} format {found}, this nclip reads format {needed} only (it was "
                             f"written by {'an older' if found < needed else 'a newer'} nclip): train it again, or "
                             "use the nclip that wrote it")


def checkpoint_step(path: str | Path) -> int | None:
    """N of a training checkpoint directory named step_N, else None."""
    match = _STEP_NAME.fullmatch(Path(path).name)
    return int(match.group(1)) if match else None


def weights_metadata() -> dict[str, str]:
    """The safetensors header of every nclip weights file: its model format. One entry only: safetensors
    writes its metadata in a hash map's order, which differs between processes, so a second entry
    would make the same weights a different file (a resumed run's model no longer equal byte for byte)."""
    return {FORMAT_KEY: str(MODEL_FORMAT)}


def check_weights(path: str | Path) -> None:
    """One line when the nclip weights file ``path`` is missing, unreadable or of another model
    format (see :data:`MODEL_FORMAT`); reads its header only, so a command can refuse it first."""
    path = Path(path)
    if not path.is_file():
        raise NclipError(f"missing weights file: {path}")
    try:
        with safe_open(str(path), framework="pt") as fh:
            found = (fh.metadata() or {}).get(FORMAT_KEY, "1")
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise NclipError(f"cannot read {path}: {_first_line(e)}") from None
    check_format(path, int(found) if found.isdigit() else 0, MODEL_FORMAT, "an nclip model of")


def read_weights(path: str | Path, device: str = "cpu") -> dict:
    """The tensors of an nclip weights file, after :func:`check_weights`."""
    check_weights(path)
    try:
        return load_file(str(path), device=device)
    except Exception as e:  # a header that reads, a body that does not
        raise NclipError(f"cannot read {path}: {_first_line(e)}") from None


def _first_line(error: Exception) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0]


def atomic_dir(final: Path):
    """A context manager yielding a temporary directory beside ``final`` that replaces it on
    success (rename is atomic on POSIX), so a crash never leaves a half-written ``final``."""
    return _AtomicDir(Path(final))


class _AtomicDir:
    def __init__(self, final: Path):
        self.final = final

    def __enter__(self) -> Path:
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.final.name}.", dir=self.final.parent))
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        fileperm.settle_tree(self.tmp)  # mkdtemp's 0700, safetensors' 0600: the umask's modes instead
        for f in self.tmp.rglob("*"):  # make the contents durable before the rename
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        old = None
        if self.final.exists():
            old = self.final.with_name(f".{self.final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(self.final, old)
        os.replace(self.tmp, self.final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return False


def save_model(model, cfg: RunConfig, directory: str | Path) -> Path:
    """Write ``directory``/model.safetensors and config.json atomically (a LoRA model merged, its
    adapter beside them: :mod:`nclip.models.lora`)."""
    directory = Path(directory)
    with atomic_dir(directory) as tmp:
        weights, saved = model.state_dict(), cfg
        if cfg.model.lora is not None:
            from nclip.models.lora import merged_for_saving

            weights, saved = merged_for_saving(model, cfg, tmp, weights_metadata())
        state = {k: v.detach().contiguous().cpu() for k, v in weights.items()}
        save_file(state, str(tmp / WEIGHTS), metadata=weights_metadata())
        (tmp / CONFIG).write_text(json.dumps(saved.model_dump(mode="json"), indent=2))
        if cfg.model.text.tokenizer is not None:
            copy_tokenizer(Path(cfg.model.text.tokenizer).expanduser(), tmp / TOKENIZER_DIR)
    return directory


def copy_tokenizer(source: Path, dest: Path) -> None:
    """The tokenizer files of ``source`` (model.text.tokenizer: CLIP's BPE vocabulary, a tokenizer.json,
    or a directory of tokenizer files) copied into the new folder ``dest``, which
    :class:`~nclip.data.tokenization.CaptionTokenizer` then reads as it read ``source``."""
    dest.mkdir()
    if clip_bpe.bpe_file(source) is not None:  # CLIP's BPE vocabulary, under its own name
        files = {clip_bpe.BPE_FILE: clip_bpe.bpe_file(source)}
    elif source.is_file():
        files = {TOKENIZER_FILES[0]: source}
    else:
        files = {n: source / n for n in TOKENIZER_FILES}
    for name, file in files.items():
        if file.is_file():
            shutil.copyfile(file, dest / name)


def read_config(directory: str | Path) -> RunConfig:
    """The config of a model directory; its tokenizer is the copy saved beside the weights, if any."""
    path = Path(directory) / CONFIG
    if not path.is_file():
        raise NclipError(f"not an nclip model directory (no {CONFIG}): {directory}")
    cfg = validate(read_json(path))
    copy = Path(directory) / TOKENIZER_DIR
    saved = (TOKENIZER_FILES[0], clip_bpe.BPE_FILE, SENTENCEPIECE_FILE)  # the file that makes a tokenizer
    if cfg.model.text.tokenizer is not None and any((copy / n).is_file() for n in saved):
        text = cfg.model.text.model_copy(update={"tokenizer": str(copy.resolve())})
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"text": text})})
    return cfg


def load_model(directory: str | Path, device: str = "cpu"):
    """(model, config) from a directory written by :func:`save_model`, in eval mode."""
    from nclip.models.dual_encoder import build_model

    directory = Path(directory)
    cfg = read_config(directory)
    model = build_model(cfg, pretrained_text=False)
    weights = directory / WEIGHTS
    state = read_weights(weights, device)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise NclipError(f"{weights} does not match its config: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model.to(device).eval(), cfg
