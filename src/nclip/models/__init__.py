"""Towers (from transformers configs), the dual encoder (its heads are nclip.heads), save/load and export."""

from nclip.models.torchvision_compat import ensure_importable

ensure_importable()  # before transformers imports it (a CUDA torchvision beside CPU torch: see the module)

from nclip.models.dual_encoder import DualEncoder, build_model  # noqa: E402

__all__ = ["DualEncoder", "build_model"]
