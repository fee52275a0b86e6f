"""Objectives: pure functions in :mod:`functional`, trainer modules registered by name here.

Adding an objective = a functional section + a module with a typed config + one REGISTRY entry.
"""

from __future__ import annotations

from nclip.objectives.base import EncoderOutput, LabelSpace, Objective, ObjectiveConfig
from nclip.objectives.clip import ClipConfig, ClipObjective
from nclip.objectives.clip_supcon import ClipSupconConfig, ClipSupconObjective
from nclip.objectives.cmsf import (
    ClipCmsfConfig,
    ClipCmsfObjective,
    CmsfConfig,
    CmsfObjective,
    XentConfig,
    XentObjective,
)
from nclip.objectives.cmsf_baselines import FrzProtoConfig, FrzProtoObjective, ProtoNwConfig, ProtoNwObjective
from nclip.objectives.nclip import NclipConfig, NclipObjective, XclipConfig, XclipObjective
from nclip.objectives.protoclip import ProtoclipConfig, ProtoclipObjective
from nclip.objectives.siglip import SiglipConfig, SiglipObjective, XsiglipConfig, XsiglipObjective
from nclip.objectives.supcon import (
    PacoConfig,
    PacoObjective,
    RecoConfig,
    RecoObjective,
    SupconConfig,
    SupconObjective,
)
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
    "protonw": (ProtoNwConfig, ProtoNwObjective),
    "frzproto": (FrzProtoConfig, FrzProtoObjective),
    "supcon": (SupconConfig, SupconObjective),
    "paco": (PacoConfig, PacoObjective),
    "reco": (RecoConfig, RecoObjective),
    "clip_supcon": (ClipSupconConfig, ClipSupconObjective),
}


def build_objective(cfg: ObjectiveConfig, run_cfg=None, label_space: LabelSpace | None = None) -> Objective:
    """The registered objective for ``cfg``; ``run_cfg`` (the RunConfig) gives it sizes from other
    sections (see :meth:`Objective.build`); ``label_space`` the run's classes (and class similarity)
    for an objective that ``needs_label_space`` (ignored by the others)."""
    cls = REGISTRY[cfg.name][1]
    if cls.needs_label_space:
        return cls.build(cfg, run_cfg, label_space=label_space)
    return cls.build(cfg, run_cfg)


__all__ = ["REGISTRY", "build_objective", "EncoderOutput", "LabelSpace", "Objective", "ObjectiveConfig"]
