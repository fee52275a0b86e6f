"""Heads as modules: each head kind is one class registered by name (:mod:`nclip.heads.base`),
built from the run config, with its forward and its outputs keyed by its name; the built-in kinds
(:mod:`nclip.heads.builtin`) and the layers they are made of (:mod:`nclip.heads.layers`)."""

from nclip.heads import builtin  # noqa: F401  (registers the built-in head kinds, in build order)
from nclip.heads.base import (
    BACKBONE,
    SIDES,
    Head,
    HeadContext,
    ImageHead,
    TwoSidedHead,
    build_heads,
    head_class,
    param_side,
    probe_description,
    probe_output,
    probe_problem,
    register_head,
    registered_heads,
)

__all__ = ["BACKBONE", "SIDES", "Head", "HeadContext", "ImageHead", "TwoSidedHead", "build_heads", "head_class",
           "param_side", "probe_description", "probe_output", "probe_problem", "register_head", "registered_heads"]
