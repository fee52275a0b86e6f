"""The built-in head kinds, registered in the order a model builds them: Tab. 9d's shared layers,
CLIP, nCLIP, ProtoCLIP, CMSF, the supervised baseline's classifier and the SupCon family's projection."""

from __future__ import annotations

import copy

import torch
from torch import nn

from nclip.heads.base import Head, HeadContext, ImageHead, TwoSidedHead, register_head
from nclip.heads.layers import CmsfMLP, NclipHead, ProtoHead, SharedLayers, SupconMLP, clip_head


def _shared_count(ctx: HeadContext) -> int:
    """Tab. 9d's #SL: hidden layers shared by the CLIP and nCLIP heads (only with both heads)."""
    return ctx.model_cfg.nclip_shared_layers if {"clip", "nclip"} <= ctx.heads else 0


def _read_widths(ctx: HeadContext) -> tuple[int, int]:
    """What the CLIP and nCLIP heads read: the towers' features f, or the shared layers' output."""
    if _shared_count(ctx):
        return ctx.model_cfg.nclip_hidden, ctx.model_cfg.nclip_hidden
    return ctx.vision.width, ctx.text.width


class _ReadsShared(TwoSidedHead):
    def side_input(self, f, outs):
        return outs.get("shared", f)


@register_head
class SharedHead(TwoSidedHead):
    """xCLIP Tab. 9d: with ``model.nclip_shared_layers`` = #SL > 0 the CLIP and nCLIP heads of a
    modality read s = shared(f), #SL hidden layers of the nCLIP head's kind held once. Built for a
    model with both heads only; no objective names it."""

    name = "shared"
    config_fields = ("nclip_shared_layers", "nclip_hidden")

    @classmethod
    def wanted(cls, ctx):
        return _shared_count(ctx) > 0

    @classmethod
    def build(cls, ctx):
        m, count = ctx.model_cfg, _shared_count(ctx)
        return cls(SharedLayers(ctx.vision.width, m.nclip_hidden, count),
                   SharedLayers(ctx.text.width, m.nclip_hidden, count))

    @property
    def count(self) -> int:
        """#SL: the shared hidden layers (Linear → BN → GELU each)."""
        return len(self.image) // 3


@register_head
class ClipHead(_ReadsShared):
    """CLIP's projection g = W f per modality, a linear layer without bias (Sec. 3.2): the head that
    ``nclip export --hf/--open-clip`` writes as ``visual_projection`` / ``text_projection``."""

    name = "clip"
    config_fields = ("embed_dim",)
    probe = "CLIP-head embeddings z, not normalised (k-NN and clustering L2-normalise)"
    # each side's Linear under transformers' CLIPModel names (export --hf, --open-clip and model.init)
    hf_names = {"image": "visual_projection", "text": "text_projection"}

    @classmethod
    def build(cls, ctx):
        widths = _read_widths(ctx)
        return cls(clip_head(widths[0], ctx.model_cfg.embed_dim), clip_head(widths[1], ctx.model_cfg.embed_dim))


@register_head
class NclipHeads(_ReadsShared):
    """nCLIP's head h per modality (Sec. 3.2, with Tab. 9c/9d's variants: :class:`NclipHead`)."""

    name = "nclip"
    config_fields = ("nclip_dim", "nclip_hidden", "nclip_layers", "nclip_bottleneck", "nclip_l2norm",
                     "nclip_last_bn", "nclip_temperature", "nclip_shared_layers")
    probe = "nCLIP-head logits, not normalised (k-NN and clustering L2-normalise)"

    @classmethod
    def build(cls, ctx):
        m, widths = ctx.model_cfg, _read_widths(ctx)
        kw = dict(layers=m.nclip_layers - _shared_count(ctx), bottleneck=m.nclip_bottleneck,
                  l2norm=m.nclip_l2norm, last_bn=m.nclip_last_bn, temperature=m.nclip_temperature)
        return cls(NclipHead(widths[0], m.nclip_hidden, m.nclip_dim, **kw),
                   NclipHead(widths[1], m.nclip_hidden, m.nclip_dim, **kw))


@register_head
class ProtoHeads(TwoSidedHead):
    """ProtoCLIP's projection h = g(z) on the CLIP embedding z (its Fig. 2), per modality."""

    name = "proto"
    after = ("clip",)
    config_fields = ("proto_hidden", "proto_dim", "embed_dim")
    probe = "ProtoCLIP-head projections h = g(z), not normalised (k-NN and clustering L2-normalise)"

    @classmethod
    def build(cls, ctx):
        m = ctx.model_cfg
        return cls(ProtoHead(m.embed_dim, m.proto_hidden, m.proto_dim),
                   ProtoHead(m.embed_dim, m.proto_hidden, m.proto_dim))

    def side_input(self, f, outs):
        return outs["clip"]


@register_head
class CmsfHead(Head):
    """CMSF (Sec. 2, Fig. 1): the online branch is the image tower g, the projection ``image`` and
    the predictor ``image_predictor`` (:class:`CmsfMLP`, sizes ``model.cmsf_hidden`` /
    ``model.cmsf_dim``); the target branch f is a copy of the tower and the projection
    (``target_vision``, ``target_image``) that is never trained (requires_grad False) but moved by
    the objective's momentum update (θf ← m·θf + (1 − m)·θg), and is in the state dict, so
    checkpoints and the saved model hold it. On a batch of two views (online/strong first) the
    training step runs the online branch on view 0 and the target branch on view 1 without
    gradient: "cmsf_pred" v = h(g(x₀)), "cmsf_target" u = f(x₁); evaluation encodes one view with
    the online tower and reads the projection, "cmsf"."""

    name = "cmsf"
    two_views = "target"
    config_fields = ("cmsf_hidden", "cmsf_dim")

    def __init__(self, vision: nn.Module, width: int, hidden: int, dim: int):
        super().__init__()
        self.image = CmsfMLP(width, hidden, dim)
        self.image_predictor = CmsfMLP(dim, hidden, dim)
        # f starts as a copy of g (BYOL, MSF); "target_" keeps it out of the image side's param groups
        self.target_vision = copy.deepcopy(vision).requires_grad_(False)
        if hasattr(self.target_vision, "patch_dropout"):  # the target encodes the whole (weak) view
            self.target_vision.patch_dropout = 0.0
        self.target_image = copy.deepcopy(self.image).requires_grad_(False)

    @classmethod
    def build(cls, ctx):
        return cls(ctx.vision, ctx.vision.width, ctx.model_cfg.cmsf_hidden, ctx.model_cfg.cmsf_dim)

    def forward(self, side, f, outs):
        return {"cmsf": self.image(f)} if side == "image" else {}

    def from_towers(self, feats):
        if "image_target" not in feats:
            return {}
        with torch.no_grad():
            return {"cmsf_target": self.target_image(feats["image_target"])}  # u (Fig. 1), no gradient

    def train_forward(self, side, f, outs):
        out = self.forward(side, f, outs)
        if "cmsf_target" in outs:  # two views: v, the predictor on the online view's projection
            out["cmsf_pred"] = self.image_predictor(out["cmsf"])
        return out

    def towers(self):
        return {"target_vision": self.target_vision}

    def encode_target(self, pixels):
        return self.target_vision(pixels)


@register_head
class XentHead(ImageHead):
    """The supervised cross-entropy baseline's linear classifier [d → C] on the image features,
    C the classes of the run's label kind: "xent" [B, C] class logits."""

    name = "xent"

    @classmethod
    def build(cls, ctx):
        return cls(nn.Linear(ctx.vision.width, ctx.count_classes()))


@register_head
class SupconHead(ImageHead):
    """The "supcon" head (SupCon, PaCo, ReCo, FrzProto, clip_supcon): ``image``, a
    :class:`SupconMLP` (sizes ``model.supcon_hidden`` / ``model.supcon_dim``) or, with FrzProto's
    ``objective.head: fc``, one linear layer, on the online image tower. On a training batch of two
    views both go through the tower and the head as one batch of 2B (BatchNorm statistics over the
    whole multi-view batch, as SupCon's code): "supcon" [B, 2, D]; on one view [B, 1, D].
    Evaluation reads "supcon" [B, D] of one view (FrzProto's readout, :mod:`nclip.eval.classifier`)."""

    name = "supcon"
    two_views = "every"
    config_fields = ("supcon_hidden", "supcon_dim")

    @classmethod
    def build(cls, ctx) -> SupconHead:
        m, width = ctx.model_cfg, ctx.vision.width
        if getattr(ctx.run_cfg.objective, "head", "mlp") == "fc":  # FrzProto's Tab. 2c "FC" row
            return cls(nn.Linear(width, m.supcon_dim))
        return cls(SupconMLP(width, m.supcon_hidden, m.supcon_dim))

    def from_towers(self, feats):
        if "image_views" not in feats:
            return {}
        views = feats["image_views"]  # every view through the head (BatchNorm over all 2N rows)
        return {"supcon": self.image(views.flatten(0, 1)).unflatten(0, views.shape[:2])}  # [B, V, D]

    def train_forward(self, side, f, outs):
        return {} if "supcon" in outs else {"supcon": self.image(f)[:, None]}  # one view: [B, 1, D]
