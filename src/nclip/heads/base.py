"""What a head is, and the registry of head kinds by name.

A head is a module on the towers' features: the dual encoder (:class:`nclip.models.DualEncoder`)
holds one per head kind its objective names (``Objective.heads``) in an ``nn.ModuleDict`` and
returns their outputs keyed by head name. A head kind says, as class attributes, what the rest of
the model needs to know about it (does the text tower run, how it reads a two-view batch), builds
itself from the run config (:meth:`Head.build`; its sizes are the ``model.<name>_*`` fields it
lists in :attr:`Head.config_fields`) and maps its outputs.

Outputs, one rule: a head writes its output under its own name ("clip": g, "nclip": h, ...), and
any further output under ``<name>_<what>`` (CMSF's "cmsf_pred", "cmsf_target"). Submodules, one
rule too: a head's image-side modules are named ``image*``, its text-side ones ``text*`` and
frozen momentum copies ``target_*`` (:func:`param_side` reads the side off a parameter's name:
the image tower's learning-rate group and locked-image tuning).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
from torch import nn

SIDES = ("image", "text")


@dataclass
class HeadContext:
    """What a head is built from: the run config (a :class:`nclip.config.RunConfig`), the towers
    (their feature widths, and the image tower itself for a head that copies it), the names of
    every head the model builds, and the run's class count (asked only by a head that needs it:
    the model builder computes it from the data)."""

    run_cfg: Any
    vision: nn.Module
    text: nn.Module
    heads: frozenset[str]
    count_classes: Callable[[], int]

    @property
    def model_cfg(self):
        return self.run_cfg.model


class Head(nn.Module):
    """One head kind. Subclasses set :attr:`name` and :attr:`sides`, build themselves in
    :meth:`build`, and compute their outputs in :meth:`forward` (one view of each row); a head
    that reads the training batch differently (every view, a target view) overrides
    :meth:`from_towers` and :meth:`train_forward` too."""

    name: ClassVar[str]
    # the sides it has modules for; a head with a text side needs the text tower to run
    sides: ClassVar[tuple[str, ...]] = ("image",)
    # the heads whose outputs it reads (they come first in the model: proto reads "clip")
    after: ClassVar[tuple[str, ...]] = ()
    # the model.* fields it is sized by: documentation that a test keeps true (each names a ModelConfig field);
    # nothing in src reads it
    config_fields: ClassVar[tuple[str, ...]] = ()
    # how it reads a training batch of two views per image, pixels [B, 2, 3, S, S]: None (it cannot),
    # "every" (each view through the tower and the head: SupCon's 2N batch) or "target" (the first
    # view online, the second through a momentum copy of the tower: CMSF)
    two_views: ClassVar[str | None] = None
    # what its image output is as the features of the linear, k-NN, clustering and realm probes
    # (`nclip eval --features <name>`, results.json's config.probe_features); None: it offers none
    probe: ClassVar[str | None] = None

    @classmethod
    def wanted(cls, ctx: HeadContext) -> bool:
        """Does a model with ``ctx.heads`` build this head? Its name among them, by default."""
        return cls.name in ctx.heads

    @classmethod
    def build(cls, ctx: HeadContext) -> Head:
        raise NotImplementedError

    def forward(self, side: str, f: torch.Tensor, outs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``side``'s outputs from the tower feature f [B, d] of one view, given the outputs of the
        heads before it (``outs``); {} for a side it has no module for."""
        raise NotImplementedError

    def from_towers(self, feats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Image outputs read straight off the towers' training features (``image_views``,
        ``image_target``), before the heads run on one view; {} by default."""
        return {}

    def train_forward(self, side: str, f: torch.Tensor, outs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """:meth:`forward` as the training step runs it; the same by default."""
        return self.forward(side, f, outs)

    def towers(self) -> dict[str, nn.Module]:
        """Tower copies the head holds (CMSF's target tower): the trainer compiles them as towers."""
        return {}

    def side_modules(self, side: str) -> list[nn.Module]:
        """The head's modules of ``side`` ("image" or "text"): those named ``{side}*``."""
        return [module for name, module in self.named_children() if name.startswith(side)]

    def encode_target(self, pixels: torch.Tensor) -> torch.Tensor:
        """A ``two_views = "target"`` head: its tower copy's features [B, d] of the second view."""
        raise NotImplementedError(f"the {self.name} head reads no target view")


class ImageHead(Head):
    """A head with one image-side module, ``image``, whose output on f is the head's output."""

    def __init__(self, image: nn.Module):
        super().__init__()
        self.image = image

    def forward(self, side, f, outs):
        return {self.name: self.image(f)} if side == "image" else {}


class TwoSidedHead(Head):
    """A head with one module per side, ``image`` and ``text``, each mapping that side's input
    (:meth:`side_input`: f by default) to the head's output."""

    sides = ("image", "text")

    def __init__(self, image: nn.Module, text: nn.Module):
        super().__init__()
        self.image, self.text = image, text

    def side_input(self, f: torch.Tensor, outs: dict[str, torch.Tensor]) -> torch.Tensor:
        return f

    def forward(self, side, f, outs):
        return {self.name: getattr(self, side)(self.side_input(f, outs))}


_HEADS: dict[str, type[Head]] = {}


def add_named(registry: dict, cls: type, kind: str) -> type:
    """Register ``cls`` in ``registry`` under ``cls.name``, an identifier; a name another class holds
    is refused (ValueError naming both). Head and score kinds register alike."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"{kind} class {cls.__qualname__} needs a name that is an identifier, got {name!r}")
    known = registry.get(name)
    if known is not None and known is not cls:
        raise ValueError(f"{kind} {name!r} is registered twice: {known.__qualname__} and {cls.__qualname__}")
    registry[name] = cls
    return cls


def register_head(cls: type[Head]) -> type[Head]:
    """Class decorator: register a head kind under ``cls.name``. A model builds its heads in the
    order they were registered (so parameters are created, and ordered, the same run after run)."""
    return add_named(_HEADS, cls, "head")


def head_class(name: str) -> type[Head]:
    """The head kind registered as ``name`` (KeyError if none)."""
    try:
        return _HEADS[name]
    except KeyError:
        raise KeyError(f"no head named {name!r}; registered: {', '.join(_HEADS)}") from None


def registered_heads() -> list[type[Head]]:
    """Every head kind, in the order of registration."""
    return list(_HEADS.values())


def build_heads(ctx: HeadContext) -> nn.ModuleDict:
    """The heads a model with ``ctx.heads`` builds, name → head, in registration order; refuses a
    name no head kind has, and a head without the heads it reads (ValueError, one line)."""
    unknown = sorted(ctx.heads - set(_HEADS))
    if unknown:
        raise ValueError(f"no head named {', '.join(map(repr, unknown))}; registered: {', '.join(_HEADS)}")
    heads = nn.ModuleDict()
    for cls in registered_heads():
        if cls.wanted(ctx):
            missing = [name for name in cls.after if name not in heads]
            if missing:
                raise ValueError(f"the {cls.name} head reads the {', '.join(missing)} head: heads must include it")
            heads[cls.name] = cls.build(ctx)
    return heads


# the probes' features besides the heads' outputs: the image tower's own ([CLS] / pooled, before
# any head), encode_image(x)["features"]
BACKBONE = "backbone"
_BACKBONE_OUTPUT = "features"
_BACKBONE_PROBE = "image backbone features ({tower}, no projection)"


def probe_output(features: str) -> str:
    """The key of ``encode_image``'s outputs that the probe features ``features`` (``backbone`` or a
    head's name, :meth:`probe_problem` checked) are: a head writes its output under its own name."""
    return _BACKBONE_OUTPUT if features == BACKBONE else features


def probe_description(features: str, tower_feature: str) -> str:
    """What the probe features ``features`` are (results.json's ``config.probe_features``), the
    backbone's naming the tower's feature (``tower_feature``, e.g. "[CLS] token")."""
    if features == BACKBONE:
        return _BACKBONE_PROBE.format(tower=tower_feature)
    return head_class(features).probe or ""


def probe_problem(features: str, heads: frozenset[str]) -> str | None:
    """Why a model with ``heads`` has no probe features ``features`` (one line), or None: the backbone
    always exists; a head must be built and offer its output (:attr:`Head.probe`)."""
    if features == BACKBONE:
        return None
    if features not in heads:
        return f"trains no {features!r} head (it has {', '.join(sorted(heads))}; {BACKBONE} features always exist)"
    if _HEADS.get(features) is None or _HEADS[features].probe is None:
        offered = [BACKBONE, *(name for name in sorted(heads) if name in _HEADS and _HEADS[name].probe)]
        return f"its {features!r} head offers no probe features (choose {', '.join(offered)})"
    return None


def param_side(name: str) -> str | None:
    """The side of a dual-encoder parameter or module named ``name`` (its state-dict key): "image"
    for the image tower and image-side head modules (``heads.<head>.image*``), "text" likewise,
    None for the rest (the logit scale, momentum copies)."""
    parts = name.split(".")
    if parts[0] == "vision":
        return "image"
    if parts[0] == "text":
        return "text"
    if parts[0] == "heads" and len(parts) > 2:
        return next((side for side in SIDES if parts[2].startswith(side)), None)
    return None
