"""The dual encoder: two towers, a CLIP head and/or an nCLIP head (and/or a ProtoCLIP head on top of
the CLIP head) per modality, a logit scale; for CMSF an image-side online projection + predictor and a
momentum (target) copy of the image tower and projection; for the SupCon family a projection MLP on
every view; for the supervised baseline a linear classifier on the image features."""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from nclip.config import RunConfig
from nclip.data.tokenization import CaptionTokenizer
from nclip.models.heads import CmsfMLP, NclipHead, ProtoHead, SharedLayers, SupconMLP, clip_head
from nclip.models.towers import build_text_tower, build_vision_tower
from nclip.objectives import plan_for
from nclip.objectives.base import EncoderOutput

LOGIT_SCALE_INIT = math.log(1 / 0.07)  # CLIP's σ = 0.07
LOGIT_SCALE_MAX = math.log(100.0)


TEXT_HEADS = frozenset({"clip", "nclip", "proto"})  # heads with a text side


class DualEncoder(nn.Module):
    """f = enc(x); g = proj_CLIP(f); h = proj_nCLIP(f) for each modality (Algorithm 1).

    With ``model.nclip_shared_layers`` = #SL > 0 (xCLIP Tab. 9d; objectives with both heads) the two
    heads of a modality read s = ``{modality}_shared_head``(f), #SL hidden layers of the nCLIP head's
    kind held once: g = proj_CLIP(s), h = proj_nCLIP(s), the latter with #TL − #SL hidden layers left.

    "cmsf" head (CMSF Sec. 2, Fig. 1): the online branch is the image tower g, the projection
    ``image_cmsf_head`` and the predictor ``image_cmsf_predictor`` (:class:`CmsfMLP`, sizes
    ``model.cmsf_hidden`` / ``model.cmsf_dim``); the target branch f is a copy of the tower and the
    projection (``target_vision``, ``target_cmsf_head``) that is never trained (requires_grad False)
    but moved by :meth:`update_cmsf_target` (θf ← m·θf + (1 − m)·θg), and is in the state dict, so
    checkpoints and the saved model hold it. With pixels [B, 2, 3, S, S] (two views, online/strong
    first) :meth:`forward` runs the online branch on view 0 and the target branch on view 1 without
    gradient; evaluation encodes single views with the online tower as before.

    "supcon" head (SupCon, PaCo, ReCo): ``image_supcon_head`` (:class:`SupconMLP`, sizes
    ``model.supcon_hidden`` / ``model.supcon_dim``) on the online image tower. With pixels
    [B, 2, 3, S, S] (and no "cmsf" head) both views go through the tower and the head as one batch of
    2B (BatchNorm statistics over the whole multi-view batch, as SupCon's code), giving
    ``image_supcon`` [B, 2, D]; the other heads and ``image_features`` see view 0. With pixels
    [B, 3, S, S], ``image_supcon`` is [B, 1, D].

    "xent" head: a linear classifier ``image_xent_head`` [d → C] on the image features, C the classes
    of the run's label kind (the supervised cross-entropy baseline).

    A model whose heads have no text side (cmsf, xent alone) does not run the text tower in
    :meth:`forward` and freezes it and the logit scale, so that no trainable parameter goes without
    a gradient (DDP needs no ``find_unused_parameters``); the text tower stays in the checkpoint.
    """

    LOGIT_SCALE_MAX = LOGIT_SCALE_MAX

    def __init__(self, cfg: RunConfig, heads: frozenset[str], pretrained_text: bool = True):
        super().__init__()
        self.heads = frozenset(heads)
        m = cfg.model
        self.cfg_text_kind = m.text.kind
        self.tokenizer = CaptionTokenizer(cfg.data.text_length, m.text.tokenizer)
        # how evaluation resizes an image for the image tower, (mode, interpolation): data.eval_resize and
        # data.eval_interpolation (an OpenCLIP checkpoint's own preprocessing), read by
        # nclip.data.transforms.eval_tensor
        self.eval_resize = (cfg.data.eval_resize, cfg.data.eval_interpolation)
        self.vision = build_vision_tower(m.vision, cfg.data.image_size)
        self.text = build_text_tower(m, self.tokenizer, cfg.data.text_length, pretrained_text)
        if m.grad_checkpointing:  # active while training only; CMSF's target copy runs without grad
            self.vision.enable_grad_checkpointing()
            self.text.enable_grad_checkpointing()
        # Tab. 9d: the first #SL hidden layers are shared by the CLIP and nCLIP heads of a modality
        self.shared_layers = m.nclip_shared_layers if {"clip", "nclip"} <= self.heads else 0
        widths = (self.vision.width, self.text.width)  # what the heads read: f, or the shared layers' output
        if self.shared_layers:
            self.image_shared_head = SharedLayers(self.vision.width, m.nclip_hidden, self.shared_layers)
            self.text_shared_head = SharedLayers(self.text.width, m.nclip_hidden, self.shared_layers)
            widths = (m.nclip_hidden, m.nclip_hidden)
        if "clip" in self.heads:
            self.image_clip_head = clip_head(widths[0], m.embed_dim)
            self.text_clip_head = clip_head(widths[1], m.embed_dim)
        if "nclip" in self.heads:
            kw = dict(layers=m.nclip_layers - self.shared_layers, bottleneck=m.nclip_bottleneck,
                      l2norm=m.nclip_l2norm, last_bn=m.nclip_last_bn, temperature=m.nclip_temperature)
            self.image_nclip_head = NclipHead(widths[0], m.nclip_hidden, m.nclip_dim, **kw)
            self.text_nclip_head = NclipHead(widths[1], m.nclip_hidden, m.nclip_dim, **kw)
        if "proto" in self.heads:  # ProtoCLIP: h = g(z) on the CLIP embedding z (its Fig. 2)
            if "clip" not in self.heads:
                raise ValueError("the proto head sits on the CLIP head: heads must include 'clip'")
            self.image_proto_head = ProtoHead(m.embed_dim, m.proto_hidden, m.proto_dim)
            self.text_proto_head = ProtoHead(m.embed_dim, m.proto_hidden, m.proto_dim)
        if "cmsf" in self.heads:
            self.image_cmsf_head = CmsfMLP(self.vision.width, m.cmsf_hidden, m.cmsf_dim)
            self.image_cmsf_predictor = CmsfMLP(m.cmsf_dim, m.cmsf_hidden, m.cmsf_dim)
            # f starts as a copy of g (BYOL, MSF); "target_" keeps it out of the image tower's
            # param groups and FSDP's head units
            self.target_vision = copy.deepcopy(self.vision).requires_grad_(False)
            if hasattr(self.target_vision, "patch_dropout"):  # the target encodes the whole (weak) view
                self.target_vision.patch_dropout = 0.0
            self.target_cmsf_head = copy.deepcopy(self.image_cmsf_head).requires_grad_(False)
        if "supcon" in self.heads:
            # FrzProto's objective.head fc: Tab. 2c's "FC" row, one linear layer instead of the MLP
            if getattr(cfg.objective, "head", "mlp") == "fc":
                self.image_supcon_head = nn.Linear(self.vision.width, m.supcon_dim)
            else:
                self.image_supcon_head = SupconMLP(self.vision.width, m.supcon_hidden, m.supcon_dim)
        if "xent" in self.heads:
            from nclip.data.labels import run_label_space
            from nclip.objectives.base import class_count

            self.image_xent_head = nn.Linear(self.vision.width, class_count(cfg.objective, run_label_space(cfg)))
        # learnable s with σ = exp(-s), initialised to ln(1/0.07) and clamped to ln(100) (CLIP), or to
        # model.logit_scale_max (raised by model.init of a SigLIP model to keep its own s, ~4.76)
        self.logit_scale = nn.Parameter(torch.tensor(LOGIT_SCALE_INIT))
        self.LOGIT_SCALE_MAX = float(m.logit_scale_max)
        self.uses_text = bool(self.heads & TEXT_HEADS)
        if not self.uses_text:
            self.text.requires_grad_(False)
            self.logit_scale.requires_grad_(False)

    def scale(self) -> torch.Tensor:
        return self.logit_scale.clamp(max=self.LOGIT_SCALE_MAX).exp()

    def encode_image(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """pixels [B, 3, H, W] → {"features": f [B, d], "emb": g [B, D], "logits": h [B, K],
        "proto": [B, d_h], "supcon": [B, D]} (the keys of the heads the model has)."""
        f = self.vision(pixels)
        out = self._project(f, "image")
        if "supcon" in self.heads:  # FrzProto's readout (nclip.eval.classifier); not on the training path
            out["supcon"] = self.image_supcon_head(f)
        return out

    def project_image(self, f: torch.Tensor) -> dict[str, torch.Tensor]:
        """Image-tower features f [N, d] through the image heads, as :meth:`encode_image` does after
        the tower: e.g. GroupViT's group tokens, embedded like the image (zero-shot segmentation)."""
        return self._project(f, "image")

    def encode_text(self, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """ids, mask [B, L] → {"features": f [B, d], "emb": g [B, D], "logits": h [B, K]}."""
        f = self.text(ids, mask)
        return self._project(f, "text")

    @torch.no_grad()
    def update_cmsf_target(self, m: float, taken: torch.Tensor | None = None) -> None:
        """The momentum update of CMSF's target branch: θf ← m·θf + (1 − m)·θg (BN statistics copied)."""
        from nclip.objectives.momentum import momentum_update

        momentum_update(self.target_vision, self.vision, m, taken)
        momentum_update(self.target_cmsf_head, self.image_cmsf_head, m, taken)

    def _project(self, f: torch.Tensor, modality: str) -> dict[str, torch.Tensor]:
        out = {"features": f}
        shared = getattr(self, f"{modality}_shared_head")(f) if self.shared_layers else f  # Tab. 9d
        if "clip" in self.heads:
            out["emb"] = getattr(self, f"{modality}_clip_head")(shared)
        if "nclip" in self.heads:
            out["logits"] = getattr(self, f"{modality}_nclip_head")(shared)
        if "proto" in self.heads:
            out["proto"] = getattr(self, f"{modality}_proto_head")(out["emb"])
        if modality == "image" and "cmsf" in self.heads:
            out["cmsf"] = self.image_cmsf_head(f)  # the projection: CMSF's embedding of an image
        if modality == "image" and "xent" in self.heads:
            out["class_logits"] = self.image_xent_head(f)
        return out

    def forward(self, pixels: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> EncoderOutput:
        """pixels [B, 3, S, S], or [B, 2, 3, S, S]: two views, the online (strong) one first (see the
        class docstring); ids, mask [B, L]. The towers, then the heads: :meth:`tower_features`,
        :meth:`head_outputs`."""
        return self.head_outputs(self.tower_features(pixels, ids, mask))

    def tower_features(self, pixels: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
                       target: bool = True) -> dict[str, torch.Tensor]:
        """The towers' half of :meth:`forward`: what the heads read, per row of the batch.

        ``image`` f [B, d] (or ``image_views`` [B, V, d]: the SupCon family's every view), ``text``
        [B, d_t] when the model uses text, and with ``target`` CMSF's target tower on the weak view,
        ``image_target`` [B, d] (no gradient; run after the online tower, so that the online tower's
        random draws come first in both passes of gradient-cached accumulation, which skips it in
        the second). Every tensor has the batch first, so micro-batches concatenate
        (:mod:`nclip.train.accumulate`)."""
        feats: dict[str, torch.Tensor] = {}
        weak = None
        if pixels.ndim == 5:
            if not self.heads & {"cmsf", "supcon"} or pixels.shape[1] != 2:
                raise ValueError(f"pixels of shape {tuple(pixels.shape)}: two views need a model with a 'cmsf' "
                                 "or 'supcon' head")
            if "cmsf" in self.heads:
                pixels, weak = pixels[:, 0], pixels[:, 1]
        if pixels.ndim == 5:  # the SupCon family's 2N multi-view batch (Eq. 1): every view through the tower
            b, v = pixels.shape[:2]
            feats["image_views"] = self.vision(pixels.flatten(0, 1)).unflatten(0, (b, v))  # [B, V, d]
        else:
            feats["image"] = self.vision(pixels)
        if self.uses_text:
            feats["text"] = self.text(ids, mask)
        if weak is not None and target:
            with torch.no_grad():
                feats["image_target"] = self.target_vision(weak)  # CMSF's target tower, no gradient
        return feats

    def head_outputs(self, feats: dict[str, torch.Tensor]) -> EncoderOutput:
        """The heads' half of :meth:`forward`: the towers' features → what the objective reads."""
        supcon, target = None, None
        if "image_target" in feats:
            with torch.no_grad():
                target = self.target_cmsf_head(feats["image_target"])  # u (Fig. 1), no gradient
        if "image_views" in feats:  # every view through the SupCon head (BatchNorm over all 2N rows)
            views = feats["image_views"]
            supcon = self.image_supcon_head(views.flatten(0, 1)).unflatten(0, views.shape[:2])  # [B, V, D]
            img = self._project(views[:, 0], "image")
        else:
            img = self._project(feats["image"], "image")
            if "supcon" in self.heads:
                supcon = self.image_supcon_head(img["features"])[:, None]  # [B, 1, D]
        txt = self._project(feats["text"], "text") if "text" in feats else {}
        return EncoderOutput(
            image_features=img["features"],
            text_features=txt.get("features"),
            image_emb=img.get("emb"),
            text_emb=txt.get("emb"),
            image_logits=img.get("logits"),
            text_logits=txt.get("logits"),
            logit_scale=self.scale(),
            image_proto=img.get("proto"),
            text_proto=txt.get("proto"),
            image_cmsf_pred=self.image_cmsf_predictor(img["cmsf"]) if target is not None else None,
            image_cmsf_target=target,
            image_class_logits=img.get("class_logits"),
            image_supcon=supcon,
        )


def build_model(cfg: RunConfig, pretrained_text: bool = True) -> DualEncoder:
    """The dual encoder with the heads that the configured objective needs."""
    heads = plan_for(cfg).heads
    return DualEncoder(cfg, heads, pretrained_text=pretrained_text)
