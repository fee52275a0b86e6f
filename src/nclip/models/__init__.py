"""Towers (from transformers configs), projection heads and the dual encoder."""

from nclip.models.dual_encoder import DualEncoder, build_model

__all__ = ["DualEncoder", "build_model"]
