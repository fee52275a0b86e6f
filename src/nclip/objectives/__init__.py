"""Objectives: pure functions in :mod:`functional`, trainer modules registered by name here.

Adding an objective = a functional section + a module with a typed config + one REGISTRY entry.
"""

from __future__ import annotations

from nclip.objectives.base import EncoderOutput, Objective, ObjectiveConfig
from nclip.objectives.clip import ClipConfig, ClipObjective
from nclip.objectives.cmsf import (
    ClipCmsfConfig,
    ClipCmsfObjective,
    CmsfConfig,
    CmsfObjective,
    XentConfig,
    XentObjective,
)
from nclip.objectives.nclip import NclipConfig, NclipObjective, XclipConfig, XclipObjective
from nclip.objectives.protoclip import ProtoclipConfig, ProtoclipObjective
from nclip.objectives.siglip import SiglipConfig, SiglipObjective, XsiglipConfig, XsiglipObjective
from nclip.objectives.unified import UnifiedConfig, UnifiedObjective
from nclip.objectives.yclip import YclipConfig, YclipObjective

# name -> (typed config, module). The config classes are unioned on ``name`` in nclip.config.
REGISTRY: dict[str, tuple[type[ObjectiveConfig], type[Objective]]] = {
    "clip": (ClipConfig, ClipObjective),
    "nclip": (NclipConfig, NclipObjective),
    "xclip": (XclipConfig, XclipObjective),
    "unified": (UnifiedConfig, UnifiedObjective),
    "yclip": (YclipConfig, YclipObjective),
    "siglip": (SiglipConfig, SiglipObjective),
    "xsiglip": (XsiglipConfig, XsiglipObjective),
    "protoclip": (ProtoclipConfig, ProtoclipObjective),
    "cmsf": (CmsfConfig, CmsfObjective),
    "clip_cmsf": (ClipCmsfConfig, ClipCmsfObjective),
    "xent": (XentConfig, XentObjective),
}


def build_objective(cfg: ObjectiveConfig, run_cfg=None) -> Objective:
    """The registered objective for ``cfg``; ``run_cfg`` (the RunConfig) gives it sizes from other
    sections (see :meth:`Objective.build`)."""
    return REGISTRY[cfg.name][1].build(cfg, run_cfg)


__all__ = ["REGISTRY", "build_objective", "EncoderOutput", "Objective", "ObjectiveConfig"]
