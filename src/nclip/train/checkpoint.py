"""Training checkpoints: atomic, the last N kept, loaded without unpickling code.

Layout: ``RUN/checkpoints/step_XXXXXXXX/`` holding ``model.safetensors`` (the weights) and
``state.pt`` (optimizer, objective state, RNG states, counters), which is read with
``torch.load(weights_only=True)``: tensors and plain containers only, so a file that would execute
code on unpickling is refused.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from nclip.errors import NclipError
from nclip.models.io import atomic_dir

PREFIX = "step_"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"{PREFIX}{step:08d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints (both files present), oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(PREFIX) and (p / "state.pt").is_file()
             and (p / "model.safetensors").is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def save_checkpoint(run_dir: Path, step: int, model, objective, optimizer, extra: dict, keep: int) -> Path:
    final = checkpoint_dir(run_dir, step)
    with atomic_dir(final) as tmp:
        weights = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        save_file(weights, str(tmp / "model.safetensors"))
        state = {
            "step": step,
            "optimizer": optimizer.state_dict(),
            "objective": objective.state_dict(),
            "rng_torch": torch.get_rng_state(),
            **extra,
        }
        torch.save(state, tmp / "state.pt")
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path, model, objective, optimizer) -> dict:
    """Restore model, objective and optimizer from ``path``; return the state dict (step, extras)."""
    try:
        state = torch.load(path / "state.pt", weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        raise NclipError(f"refusing to load {path / 'state.pt'}: it holds more than tensors ({str(e).splitlines()[0]})") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise NclipError(f"cannot read checkpoint {path}: {str(e).splitlines()[0]}") from None
    model.load_state_dict(load_file(str(path / "model.safetensors")))
    objective.load_state_dict(state["objective"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng_torch"])
    return state
