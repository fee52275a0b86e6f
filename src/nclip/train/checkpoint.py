"""Training checkpoints: atomic, the last N kept, loaded without unpickling code.

Layout: ``RUN/checkpoints/step_XXXXXXXX/`` holding

- ``model.safetensors`` — the model weights (full, also under FSDP);
- ``state.pt`` — everything else needed to continue *exactly*: the step (which is also the
  position of the learning-rate schedule and of the step-indexed data), the optimizer state, the
  objective's state (queues, centers, prototypes, learnable biases), every rank's RNG states
  (torch, CUDA, NumPy, Python), every rank's data position (for streamed shards: records consumed
  and bad samples skipped per loader worker), the loop's counters, under ``train.precision:
  fp16``, the loss scale and its growth count (:mod:`nclip.train.loss_scale`; bf16 needs none) and,
  for a plugin objective, the path and sha256 of its file (:mod:`nclip.train.resume_fit`).

``state.pt`` carries :data:`FORMAT`, and the weights the model format of :mod:`nclip.models.io`: a
checkpoint of another version is refused in one line, naming the file and both versions (it is not
damaged, so no older checkpoint is tried instead). There is no reading of older layouts.

``state.pt`` holds tensors and plain containers only and is read with
``torch.load(weights_only=True)``, so a file that would execute code on unpickling is refused with
a one-line :class:`NclipError`. A directory is complete once it has both files (it is written to a
temporary name and renamed), so a run killed at any moment leaves only complete checkpoints behind.
"""

from __future__ import annotations

import pickle
import random
import shlex
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from nclip.errors import NclipError
from nclip.jsonio import writing
from nclip.models.io import (
    STEP_PREFIX,
    FormatMismatch,
    atomic_dir,
    check_format,
    checkpoint_step,
    read_weights,
    weights_metadata,
)

FORMAT = 3  # state.pt layout version; 3: the model format 2 beside it, no keys of older layouts read


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"{STEP_PREFIX}{step:08d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints (both files present), oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if checkpoint_step(p) is not None
             and (p / "state.pt").is_file() and (p / "model.safetensors").is_file()]
    return sorted(found, key=checkpoint_step)


def save_checkpoint(run_dir: Path, step: int, weights: dict[str, torch.Tensor], state: dict, keep: int) -> Path:
    """Write ``weights`` (model.safetensors) and ``state`` (state.pt) atomically; keep the last
    ``keep`` checkpoints. ``state`` must hold tensors and plain containers only."""
    final = checkpoint_dir(run_dir, step)
    weights = {k: v.detach().contiguous().cpu() for k, v in weights.items()}
    with writing(final), atomic_dir(final) as tmp:  # a full disk: one line; the temporary is removed
        save_file(weights, str(tmp / "model.safetensors"), metadata=weights_metadata())
        torch.save({"format": FORMAT, "step": step, **state}, tmp / "state.pt")
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def kept_note(run_dir: Path) -> str:
    """What a run that stops on a failed write keeps, and how to go on from it."""
    found = list_checkpoints(run_dir)
    if not found:
        return "no checkpoint had been written yet"
    return (f"the last good checkpoint, {found[-1]}, is kept: make room, then continue with "
            f"nclip train --out {shlex.quote(str(run_dir))} --resume auto")


def read_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(weights, state) of the checkpoint directory ``path``, read without unpickling code."""
    path = Path(path)
    try:
        state = torch.load(path / "state.pt", weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        raise NclipError(f"refusing to load {path / 'state.pt'}: it holds more than tensors and plain "
                         f"containers ({str(e).splitlines()[0][:160]})") from None
    except FileNotFoundError:
        raise NclipError(f"checkpoint {path} has no state.pt") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise NclipError(f"cannot read checkpoint {path / 'state.pt'}: {str(e).splitlines()[0]}") from None
    if not isinstance(state, dict) or "step" not in state:
        raise NclipError(f"{path / 'state.pt'} is not an nclip training state")
    found = state.get("format")  # a version, or none at all in the oldest states
    check_format(path / "state.pt", found if isinstance(found, int) else 1, FORMAT, "a training state of")
    if not (path / "model.safetensors").is_file():
        raise NclipError(f"checkpoint {path} has no model.safetensors")
    return read_weights(path / "model.safetensors"), state


def newest_good_checkpoint(run_dir: Path, warn=None) -> tuple[Path, dict[str, torch.Tensor], dict] | None:
    """The newest checkpoint of ``run_dir`` that reads cleanly, as (path, weights, state); older
    ones are tried when a newer one is damaged (``warn`` is told which, once one reads). None if
    there is no checkpoint at all; if none reads cleanly, one line (the newest one's problem, and
    the way out) rather than silently starting over."""
    damaged: list[tuple[Path, NclipError]] = []
    for path in reversed(list_checkpoints(run_dir)):
        try:
            weights, state = read_checkpoint(path)
        except FormatMismatch:  # not damaged: an older checkpoint is no better
            raise
        except NclipError as e:
            damaged.append((path, e))
            continue
        for bad, e in damaged:
            (warn or _stderr)(f"skipping damaged checkpoint {bad.name}: {_short(e)}")
        return path, weights, state
    if damaged:
        every = "the only checkpoint is" if len(damaged) == 1 else f"all {len(damaged)} checkpoints are"
        raise NclipError(f"no usable checkpoint in {Path(run_dir) / 'checkpoints'}: {every} damaged (newest: "
                         f"{_short(damaged[0][1])}); nothing to resume from: start over with --force, or train "
                         "into a new --out")
    return None


def _short(error: Exception, limit: int = 160) -> str:
    """An error's first line, cut to ``limit`` characters (torch's explanations run to pages)."""
    text = (str(error).splitlines() or [""])[0]
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _stderr(msg: str) -> None:
    print(f"nclip: warning: {msg}", file=sys.stderr)


# --------------------------------------------------------------------------------------------
# RNG states as tensors and plain containers (weights_only-loadable)
# --------------------------------------------------------------------------------------------


def rng_state() -> dict:
    """This process's RNG states: torch (CPU), every visible CUDA device's (if CUDA is initialised:
    a tower or an objective may draw on a device other than the current one), NumPy's and
    Python's global generators."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, py_state, py_gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "python": {"version": version, "state": list(py_state), "gauss": py_gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()  # [one state per device]
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` saved (CUDA's: the devices this process has, when it saved any)."""
    torch.set_rng_state(state["torch"])
    n, p = state["numpy"], state["python"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
    if "cuda" in state and torch.cuda.is_available():  # a run resumed on fewer devices restores those it has
        for index, device_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(device_state, index)
