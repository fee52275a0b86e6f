"""Weight interpolation of two models of one architecture (WiSE-FT, Wortsman et al. 2022, Eq. 1):
θ = (1 − α)·θ_A + α·θ_B, written as an nclip model directory (``nclip merge``, ``nclip.merge``).

Every floating-point tensor of the state dict is interpolated (BatchNorm's running mean and
variance included, as WiSE-FT interpolates whole state dicts), in float64 and cast back to A's
dtype, so that α = 0 gives A's tensors and α = 1 gives B's bit for bit. Integer buffers (BatchNorm's
``num_batches_tracked``, counters) have no halfway value: they are A's. The merged directory takes
A's config.json and tokenizer copy, so it is A's run config with the interpolated weights; a
``merge.json`` beside them records the two sources and α.

Two models merge only when their architectures agree: the model sections of their configs
(except the settings that change no weight: ``init``, ``init_arch``, ``grad_checkpointing``, the
text tower's ``tokenizer`` path and ``unlocked_layers``), the state-dict keys, shapes and dtypes;
the first difference is a one-line error naming it.

A source with a NaN or infinite weight is refused, in one line naming it and the tensor: the merge
would be NaN there at every α (0·NaN is NaN), and so would every embedding through it. A model with
such weights is broken (a diverged run), not one to mix.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from pathlib import Path

from nclip.errors import NclipError
from nclip.jsonio import read_json
from nclip.models.io import CONFIG, TOKENIZER_DIR, WEIGHTS, atomic_dir, read_weights, weights_metadata
from nclip.overwrite import MERGE, check_output_folder
from nclip.runlock import LOCK_NAME, DirLock

RECORD = "merge.json"  # beside the merged weights: sources and α
assert MERGE.markers == (RECORD,)  # how nclip.overwrite tells a merge's folder
# model-section settings that change no weight (where the weights came from, how the backward runs,
# where the tokenizer file was, which layers a LiT run trained): two models may differ in them
NOT_ARCHITECTURE = ("init", "init_arch", "grad_checkpointing", "text.tokenizer", "text.unlocked_layers")


def model_directory(path: str | Path, option: str) -> Path:
    """A model directory (config.json + model.safetensors), or a run directory's RUN/model."""
    p = Path(path).expanduser()
    for d in (p, p / "model"):
        if (d / CONFIG).is_file() and (d / WEIGHTS).is_file():
            return d
    raise NclipError(f"{option} {path}: not an nclip model directory or run directory (expected {CONFIG} and "
                     f"{WEIGHTS} in it or in its model/)")


def check_alpha(alpha: float) -> float:
    try:
        alpha = float(alpha)
    except (TypeError, ValueError):
        raise NclipError(f"--alpha must be a number in [0, 1], got {alpha!r}") from None
    if not math.isfinite(alpha) or not 0.0 <= alpha <= 1.0:
        raise NclipError(f"--alpha must be in [0, 1] (0: A's weights, 1: B's), got {alpha:g}")
    return alpha


def check_target(out: Path, sources: tuple[Path, ...], force: bool) -> None:
    """Refuse an ``out`` that is a source, a run, a checkpoint or another command's output, or lies in
    a run's files (even with ``force``: :func:`nclip.overwrite.check_output_folder`), a file, and a
    non-empty directory unless ``force``."""
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise NclipError(f"--out {out} is a file, not a directory")
    check_output_folder(out, "--out", MERGE)
    if any(out.resolve() == s.resolve() for s in sources):  # an earlier merge, merged again
        raise NclipError(f"--out {out} is a model being merged; merge into a new directory")
    if out.is_dir() and any(p.name != LOCK_NAME for p in out.iterdir()) and not force:
        raise NclipError(f"--out {out} already exists and is not empty; choose a new directory, or pass --force "
                         "to write over it")


def _architecture(model_section: dict) -> dict:
    """The model section without the settings of :data:`NOT_ARCHITECTURE`, flattened ("text.width")."""
    flat = {}

    def walk(tree: dict, prefix: str) -> None:
        for key, value in tree.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            elif f"{prefix}{key}" not in NOT_ARCHITECTURE:
                flat[f"{prefix}{key}"] = value

    walk(model_section, "")
    return flat


def _tokenizer_digest(model_dir: Path) -> str:
    """The content of the directory's tokenizer copy (empty: none), to compare two models' vocabularies."""
    h = hashlib.sha256()
    for f in sorted((model_dir / TOKENIZER_DIR).glob("*")):
        if f.is_file():
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def check_same_architecture(dir_a: Path, dir_b: Path, state_a: dict, state_b: dict) -> None:
    """One line naming the first difference: a model-section setting, a key, a shape or a dtype."""
    from nclip.models.io import read_config

    cfg_a, cfg_b = (read_config(d).model.model_dump(mode="json") for d in (dir_a, dir_b))  # validated both
    arch_a, arch_b = _architecture(cfg_a), _architecture(cfg_b)
    for key in sorted(set(arch_a) | set(arch_b)):
        if arch_a.get(key) != arch_b.get(key):
            raise NclipError(f"cannot merge different architectures: model.{key} is {arch_a.get(key)!r} in A, "
                             f"{arch_b.get(key)!r} in B")
    if _tokenizer_digest(dir_a) != _tokenizer_digest(dir_b):
        raise NclipError("cannot merge different architectures: the tokenizer copies (model.text.tokenizer) differ")
    for key in sorted(set(state_a) | set(state_b)):
        if key not in state_a or key not in state_b:
            raise NclipError(f"cannot merge different architectures: tensor {key} is only in "
                             f"{'A' if key in state_a else 'B'}")
        a, b = state_a[key], state_b[key]
        if a.shape != b.shape or a.dtype != b.dtype:
            raise NclipError(f"cannot merge different architectures: tensor {key} is {a.dtype} {list(a.shape)} "
                             f"in A, {b.dtype} {list(b.shape)} in B")


def check_finite(state: dict, which: str, directory: Path) -> None:
    """One line naming the first floating-point tensor of ``state`` with a NaN or infinite value."""
    import torch

    bad = [(key, int((~torch.isfinite(t)).sum())) for key, t in state.items() if t.is_floating_point()]
    bad = [(key, n) for key, n in bad if n]
    if bad:
        key, n = bad[0]
        more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
        raise NclipError(f"{which} {directory}: tensor {key} holds {n} NaN or infinite value{'s' * (n != 1)} of "
                         f"{state[key].numel()}{more}; the merge would be NaN there at every alpha: merge models whose "
                         "weights are finite")


def interpolate(state_a: dict, state_b: dict, alpha: float) -> dict:
    """(1 − α)·A + α·B for every floating-point tensor (in float64, cast back: exact at α = 0 and
    1); integer and boolean tensors are A's. Same keys, shapes and dtypes as ``state_a``."""
    out = {}
    for key, a in state_a.items():
        b = state_b[key]
        if a.is_floating_point():
            mixed = (1.0 - alpha) * a.double() + alpha * b.double()
            out[key] = mixed.to(a.dtype).contiguous()
        else:
            out[key] = a.clone()
    return out


def merge(a: str | Path, b: str | Path, alpha: float, out: str | Path, force: bool = False) -> Path:
    """Write θ = (1 − α)·θ_A + α·θ_B to the model directory ``out`` (``a``, ``b``: run or model
    directories of one architecture) and return it. ``out`` is locked for the write
    (:mod:`nclip.runlock`) and replaced atomically: a temporary directory beside it, then a rename."""
    alpha = check_alpha(alpha)
    dir_a, dir_b = model_directory(a, "A"), model_directory(b, "B")
    out = Path(out).expanduser()
    sources = (dir_a, dir_b, Path(a).expanduser(), Path(b).expanduser())
    check_target(out, sources, force)
    state_a, state_b = read_weights(dir_a / WEIGHTS), read_weights(dir_b / WEIGHTS)
    check_same_architecture(dir_a, dir_b, state_a, state_b)
    check_finite(state_a, "A", dir_a)
    check_finite(state_b, "B", dir_b)
    merged = interpolate(state_a, state_b, alpha)
    with DirLock(out, "nclip merge"):
        check_target(out, sources, force)  # again under the lock: another writer may have filled it
        _write(out, dir_a, dir_b, merged, alpha)
    return out


def _write(out: Path, dir_a: Path, dir_b: Path, merged: dict, alpha: float) -> None:
    from safetensors.torch import save_file

    integer = sorted(k for k, v in merged.items() if not v.is_floating_point())
    with atomic_dir(out) as tmp:
        save_file(merged, str(tmp / WEIGHTS), metadata=weights_metadata())
        shutil.copyfile(dir_a / CONFIG, tmp / CONFIG)
        if (dir_a / TOKENIZER_DIR).is_dir():
            shutil.copytree(dir_a / TOKENIZER_DIR, tmp / TOKENIZER_DIR)
        record = {"a": str(dir_a.resolve()), "b": str(dir_b.resolve()), "alpha": alpha,
                  "rule": "(1 - alpha) * A + alpha * B for floating-point tensors; integer tensors and config from A",
                  "integer_tensors_from_a": integer}
        (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
        _carry_lock(out, tmp)


def _carry_lock(out: Path, tmp: Path) -> None:
    """A hard link of ``out``'s held lock file into the new directory: after the rename the lock
    path names the very file this process holds locked, so no other writer gets in between."""
    try:
        os.link(out / LOCK_NAME, tmp / LOCK_NAME)
    except OSError:  # no lock file (a filesystem without locks): nothing to carry
        pass


def describe(out: Path) -> str:
    record = read_json(Path(out) / RECORD)
    ints = len(record["integer_tensors_from_a"])
    return (f"wrote {out}: (1 - {record['alpha']:g}) * {record['a']} + {record['alpha']:g} * {record['b']} "
            f"(floating-point tensors; config and {ints} integer tensor{'s' * (ints != 1)}, e.g. BatchNorm's "
            "num_batches_tracked, from A)")
