"""``nclip export``'s formats (docs/export.md): a transformers CLIPModel
(:mod:`nclip.models.export_transformers`), open_clip's hub layout (:mod:`nclip.models.export_openclip`),
ONNX graphs (:mod:`nclip.models.export_onnx`). Each writes a new folder atomically
(:mod:`nclip.models.export_base`) and refuses in one line what its format cannot express."""

from __future__ import annotations

from pathlib import Path

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
    from nclip.models.export_transformers import export_hf

    return export_hf(checkpoint, out)
