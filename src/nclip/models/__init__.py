"""Towers (from transformers configs), projection heads and the dual encoder."""

from nclip.models.torchvision_compat import ensure_importable

ensure_importable()  # before transformers imports it (a CUDA torchvision beside CPU torch: see the module)

from nclip.models.dual_encoder import DualEncoder, build_model  # noqa: E402

__all__ = ["DualEncoder", "build_model"]
