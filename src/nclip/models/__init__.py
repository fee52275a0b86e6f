"""Towers (from transformers configs), the dual encoder (its heads are nclip.heads), save/load and export."""

from nclip.models.dual_encoder import DualEncoder, build_model

__all__ = ["DualEncoder", "build_model"]
