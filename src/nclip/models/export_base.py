"""What every ``nclip export`` format shares (:mod:`nclip.models.exporters`): the model directory it
reads, the check of the formats that score by the CLIP head's cosine (transformers, open_clip), and the
folder it writes, atomically and with a record that ``nclip export`` wrote it."""

from __future__ import annotations

import json
import os
import stat
from contextlib import contextmanager
from pathlib import Path

from nclip.errors import NclipError
from nclip.jsonio import writing
from nclip.models.io import CONFIG, atomic_dir
from nclip.overwrite import EXPORT
from nclip.runlock import LOCK_NAME


def model_dir(path: Path) -> Path:
    """Accept a run directory (RUN/model) or a model directory."""
    path = Path(path)
    if (path / CONFIG).is_file():
        return path
    if (path / "model" / CONFIG).is_file():
        return path / "model"
    raise NclipError(f"no nclip model found in {path} (expected {CONFIG} or model/{CONFIG})")


def check_clip_score(cfg, option: str) -> None:
    """Refuse, in one line, to write a CLIPModel or an open_clip model (``option``) of a run whose
    zero-shot score (its plan's ``zero_shot``) is not a cosine of the CLIP head's projections: that
    is the one score those formats compute, so the export would not predict as ``nclip eval`` does."""
    from nclip.objectives import plan_for
    from nclip.objectives.scores import CosineScore

    score = plan_for(cfg).zero_shot
    if score is None or score.head != "clip" or not isinstance(score, CosineScore):
        what = "no zero-shot score (image-only)" if score is None else f"the {score.name!r} score ({score.head} head)"
        raise NclipError(f"export {option}: the format scores by the cosine of the CLIP head's projections; objective "
                         f"{cfg.objective.name!r} transfers zero-shot with {what}")


# beside every export, {"format": ...}: says that nclip export wrote the folder, so that export --force
# replaces it, and never a model of the same layout that came from elsewhere (nclip.overwrite)
EXPORT_RECORD = "nclip_export.json"
assert EXPORT.markers == (EXPORT_RECORD,)


@contextmanager
def atomic_export(out: Path, fmt: str):
    """A temporary folder beside ``out`` to write the export (of format ``fmt``, recorded in
    :data:`EXPORT_RECORD`) into, which replaces ``out`` when the
    block ends without error (:func:`nclip.models.io.atomic_dir`): a failed or interrupted export
    leaves ``out`` as it was, never half written. The run lock that ``nclip export`` holds,
    ``out/.nclip.lock``, is hard-linked into the new folder first, so that the locked file is still
    at its path after the rename (a filesystem without hard links: the lock leaves with the old folder).
    The files get the umask's modes, the folder keeps the mode it had (a user's 0700 folder stays 0700)."""
    out = Path(out)
    mode = stat.S_IMODE(out.stat().st_mode) if out.is_dir() else None
    with writing(out):
        with atomic_dir(out) as tmp:
            yield tmp
            (tmp / EXPORT_RECORD).write_text(json.dumps({"format": fmt}) + "\n")
            if (out / LOCK_NAME).is_file():
                try:
                    os.link(out / LOCK_NAME, tmp / LOCK_NAME)
                except OSError:
                    pass
        if mode is not None:
            os.chmod(out, mode)
