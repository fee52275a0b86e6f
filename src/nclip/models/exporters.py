"""``nclip export``'s formats (docs/export.md): a transformers CLIPModel (:mod:`nclip.models.export`),
open_clip's hub layout (:mod:`nclip.models.export_openclip`), ONNX graphs (:mod:`nclip.models.export_onnx`).
Each writes a new folder atomically and refuses in one line what its format cannot express."""

from __future__ import annotations

from pathlib import Path

from nclip.errors import NclipError

FORMATS = {"hf": "--hf", "open_clip": "--open-clip", "onnx": "--onnx"}  # export's argparse dests → options


def export(fmt: str, checkpoint: Path, out: Path) -> str:
    """Export the model of ``checkpoint`` in format ``fmt`` (a key of :data:`FORMATS`) to ``out``;
    the line to print. Each format's module is imported only when it is asked for."""
    if fmt == "open_clip":
        from nclip.models.export_openclip import export_openclip

        return export_openclip(checkpoint, out)
    if fmt == "onnx":
        from nclip.models.export_onnx import export_onnx

        return export_onnx(checkpoint, out)
    from nclip.models.export import export_hf

    return export_hf(checkpoint, out)


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
