"""Where a run's scalars go besides metrics.jsonl: ``train.report_to: [tensorboard, wandb]``
(``train.tensorboard: true`` is the older spelling of ``[tensorboard]``; docs/runs.md).

Each reporter gets every row metrics.jsonl gets, at the same step, and logs its numeric entries
under the same keys (rank 0 only: :class:`nclip.train.logbook.Log` builds them there). The
config checked that each one's optional package is installed, before training started.

- ``tensorboard``: event files in RUN/tensorboard/ (``pip install 'nclip[tensorboard]'``).
- ``wandb``: a Weights & Biases run whose files are in RUN/wandb/ (``pip install 'nclip[wandb]'``),
  its config the run's resolved config (config.yaml's), its name the run directory's. Project,
  entity and mode come from W&B's own environment (``WANDB_PROJECT``, default "nclip";
  ``WANDB_ENTITY``; ``WANDB_MODE=offline`` to log without a network and ``wandb sync`` later). The
  W&B run id is kept in RUN/wandb/nclip-run-id, so a resumed nclip run continues the same W&B run
  (a run started over with --force gets a new one); a file there that holds no run id is one line.
  The console is not captured (nclip's stdout and stderr stay untouched; metrics.jsonl's scalars are
  what W&B gets).

A package that is installed but fails to import (a broken install, a dependency of the wrong
version) is one line naming the package and the error, as a missing one is.
"""

from __future__ import annotations

import importlib
import os
import re
import secrets
from pathlib import Path

from nclip.errors import NclipError

TENSORBOARD = "tensorboard"  # RUN/tensorboard/: the event files of train.report_to tensorboard
WANDB = "wandb"  # RUN/wandb/: the W&B run's files (W&B's `dir`)
WANDB_ID = "nclip-run-id"  # RUN/wandb/nclip-run-id: the W&B run id, for a resumed run
# what W&B takes as a run id (it refuses / \ # ? % : and the like); nclip writes 8 hex digits
_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _import(module: str, name: str):
    """``importlib.import_module(module)`` for reporter ``name``, or one line when the installed
    package fails to import."""
    try:
        return importlib.import_module(module)
    except Exception as e:  # anything a broken install raises: ImportError, AttributeError, TypeError, ...
        reason = (str(e).strip().splitlines() or [""])[0][:160]
        raise NclipError(f"train.report_to {name}: `import {module}` fails ({type(e).__name__}: {reason}); reinstall "
                         f"it (pip install --force-reinstall 'nclip[{name}]'), or take {name} out of train.report_to"
                         ) from None


def scalars(row: dict) -> dict[str, float]:
    """The row's numbers (not the step, not lists of warnings or flags)."""
    return {k: v for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoardReporter:
    def __init__(self, run_dir: Path):
        SummaryWriter = _import("torch.utils.tensorboard", TENSORBOARD).SummaryWriter
        self.folder = Path(run_dir) / TENSORBOARD
        self.writer = SummaryWriter(log_dir=str(self.folder))

    def log(self, row: dict, step: int) -> None:
        from nclip.jsonio import writing

        with writing(self.folder):  # a failed write is one line; the writer's thread re-raises its failure here
            for key, value in scalars(row).items():
                self.writer.add_scalar(key, value, step)
            self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbReporter:
    def __init__(self, run_dir: Path, config: dict, resuming: bool):
        wandb = _import("wandb", WANDB)
        from nclip.jsonio import write_text_atomic, writing

        folder = Path(run_dir) / WANDB
        id_file = folder / WANDB_ID
        with writing(id_file):
            folder.mkdir(parents=True, exist_ok=True)
            # a resumed run continues its W&B run; a new one (--force included) starts another
            run_id = saved_run_id(id_file) if resuming and id_file.is_file() else secrets.token_hex(4)
        write_text_atomic(id_file, run_id + "\n")
        try:
            self.run = wandb.init(dir=str(run_dir), config=config, name=Path(run_dir).resolve().name, id=run_id,
                                  resume="allow", project=os.environ.get("WANDB_PROJECT", "nclip"),
                                  reinit="finish_previous",  # a second run in one process (tests, sweeps)
                                  settings=wandb.Settings(console="off"))  # nclip's stdout and stderr as they are
        except Exception as e:  # no login, no network, a bad WANDB_* setting: W&B's own error types
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise NclipError(f"train.report_to wandb: cannot start a W&B run ({reason}); log in with `wandb login`, "
                             "or set WANDB_MODE=offline and `wandb sync` later") from None

    def log(self, row: dict, step: int) -> None:
        self.run.log(scalars(row), step=step)

    def close(self) -> None:
        self.run.finish()


def saved_run_id(id_file: Path) -> str:
    """The W&B run id a run saved (RUN/wandb/nclip-run-id); one line if the file holds none."""
    try:
        run_id = id_file.read_bytes().decode("utf-8").strip()
    except UnicodeDecodeError as e:
        run_id, why = "", f"not UTF-8 text: byte {e.start}"
    else:
        why = f"{run_id[:40]!r}: W&B takes 1 to 64 letters, digits, - and _" if run_id else "empty"
    if not _RUN_ID.fullmatch(run_id):
        raise NclipError(f"{id_file}: not a W&B run id ({why}); write the id of the W&B run this run continues "
                         "into it, or delete the file to log the rest of the run to a new W&B run")
    return run_id


def reporters(run_dir: Path, cfg, resuming: bool) -> list:
    """The reporters of ``cfg.train.report_to`` (call on rank 0 only; ``resuming``: the run
    continues from a checkpoint)."""
    out = []
    if TENSORBOARD in cfg.train.report_to or cfg.train.tensorboard:
        out.append(TensorBoardReporter(run_dir))
    if WANDB in cfg.train.report_to:
        out.append(WandbReporter(run_dir, cfg.model_dump(mode="json"), resuming))
    return out
