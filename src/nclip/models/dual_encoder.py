"""The dual encoder: two towers, the heads its objective names (:mod:`nclip.heads`: CLIP, nCLIP,
ProtoCLIP, CMSF, the SupCon family's, the supervised classifier, a plug-in's own) in one
``nn.ModuleDict``, and a logit scale."""

from __future__ import annotations

import math

import torch
from torch import nn

from nclip.config import RunConfig
from nclip.data.tokenization import CaptionTokenizer
from nclip.data.transforms import preprocess_of
from nclip.heads import HeadContext, build_heads
from nclip.models.size_check import check_model_size
from nclip.models.towers import build_text_tower, build_vision_tower
from nclip.objectives import plan_for
from nclip.objectives.base import EncoderOutput

LOGIT_SCALE_INIT = math.log(1 / 0.07)  # CLIP's σ = 0.07
LOGIT_SCALE_MAX = math.log(100.0)


class DualEncoder(nn.Module):
    """f = enc(x) per modality, then the heads on f: ``heads`` maps a head's name to the head
    (:class:`nclip.heads.Head`), built in the heads' registration order; each head's outputs are
    keyed by its name (Algorithm 1's g = proj_CLIP(f) is "clip", h = proj_nCLIP(f) is "nclip").

    Two views per image (pixels [B, 2, 3, S, S], the online/strong view first) are read by the
    head that says how (``Head.two_views``): "target" (CMSF) runs the online tower on view 0 and
    the head's momentum copy of the tower on view 1 without gradient; "every" (the SupCon family)
    runs both views through the tower and the head as one batch of 2B (BatchNorm statistics over
    the whole multi-view batch, as SupCon's code), the other heads and ``image_features`` seeing
    view 0. Evaluation encodes single views with the online tower.

    A model whose heads have no text side (cmsf, xent, supcon alone) does not run the text tower
    in :meth:`forward` and freezes it and the logit scale, so that no trainable parameter goes
    without a gradient (DDP needs no ``find_unused_parameters``); the text tower stays in the
    checkpoint.
    """

    LOGIT_SCALE_MAX = LOGIT_SCALE_MAX

    def __init__(self, cfg: RunConfig, heads: frozenset[str], pretrained_text: bool = True):
        super().__init__()
        check_model_size(cfg, heads)  # before anything is allocated: absurd sizes are one line
        m = cfg.model
        self.cfg_text_kind = m.text.kind
        self.tokenizer = CaptionTokenizer(cfg.data.text_length, m.text.tokenizer)
        # how evaluation pre-processes an image for the image tower (a checkpoint's own preprocessing:
        # data.eval_resize, eval_interpolation, eval_convention), read by nclip.data.transforms.eval_tensor
        self.eval_resize = preprocess_of(cfg.data)
        self.vision = build_vision_tower(m.vision, cfg.data.image_size)
        self.text = build_text_tower(m, self.tokenizer, cfg.data.text_length, pretrained_text)
        if m.grad_checkpointing:  # active while training only; CMSF's target copy runs without grad
            self.vision.enable_grad_checkpointing()
            self.text.enable_grad_checkpointing()
        self.heads = build_heads(HeadContext(cfg, self.vision, self.text, frozenset(heads), lambda: _classes(cfg)))
        # learnable s with σ = exp(-s), initialised to ln(1/0.07) and clamped to ln(100) (CLIP), or to
        # model.logit_scale_max (raised by model.init of a SigLIP model to keep its own s, ~4.76)
        self.logit_scale = nn.Parameter(torch.tensor(LOGIT_SCALE_INIT))
        self.LOGIT_SCALE_MAX = float(m.logit_scale_max)
        self.uses_text = any("text" in head.sides for head in self.heads.values())
        if not self.uses_text:
            self.text.requires_grad_(False)
            self.logit_scale.requires_grad_(False)
        if m.lora is not None:  # peft's LoRA in the towers, their base weights frozen (nclip.models.lora)
            from nclip.models.lora import adapt_towers

            adapt_towers(self, cfg)

    def scale(self) -> torch.Tensor:
        return self.logit_scale.clamp(max=self.LOGIT_SCALE_MAX).exp()

    def towers(self) -> dict[str, nn.Module]:
        """Every tower by name: the image and text towers, and the copies heads hold (CMSF's
        ``target_vision``)."""
        out = {"vision": self.vision, "text": self.text}
        for head in self.heads.values():
            out.update(head.towers())
        return out

    def encode_image(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """pixels [B, 3, H, W] → {"features": f [B, d], <head>: its output, ...}, e.g. "clip" g [B, D],
        "nclip" h [B, K] (the image-side outputs of the model's heads)."""
        return self.project_image(self.vision(pixels))

    def project_image(self, f: torch.Tensor) -> dict[str, torch.Tensor]:
        """Image-tower features f [N, d] through the image heads, as :meth:`encode_image` does after
        the tower: e.g. GroupViT's group tokens, embedded like the image (zero-shot segmentation)."""
        return {"features": f, **self._project(f, "image", {})}

    def encode_text(self, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """ids, mask [B, L] → {"features": f [B, d], <head>: its output, ...} (text-side heads)."""
        f = self.text(ids, mask)
        return {"features": f, **self._project(f, "text", {})}

    def _project(self, f: torch.Tensor, side: str, outs: dict[str, torch.Tensor],
                 training: bool = False) -> dict[str, torch.Tensor]:
        """The heads with a ``side`` on f, in order (a head reads the outputs before it in ``outs``)."""
        for head in self.heads.values():
            if side in head.sides:
                outs.update(head.train_forward(side, f, outs) if training else head(side, f, outs))
        return outs

    def forward(self, pixels: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> EncoderOutput:
        """pixels [B, 3, S, S], or [B, 2, 3, S, S]: two views, the online (strong) one first (see the
        class docstring); ids, mask [B, L], or [B, C, L]: C captions per image (``data.caption_choice:
        all``), whose text features and text-side head outputs are then [B, C, ...]. The towers, then
        the heads: :meth:`tower_features`, :meth:`head_outputs`."""
        return self.head_outputs(self.tower_features(pixels, ids, mask))

    def tower_features(self, pixels: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
                       target: bool = True) -> dict[str, torch.Tensor]:
        """The towers' half of :meth:`forward`: what the heads read, per row of the batch.

        ``image`` f [B, d] (or ``image_views`` [B, V, d]: every view, for a head that reads them
        all), ``text`` [B, d_t] when the model uses text ([B, C, d_t] for ids [B, C, L]: the C captions
        of each image through the tower as one batch of B·C), and with ``target`` the momentum copy of
        the tower on the second view, ``image_target`` [B, d] (no gradient; run after the online
        tower, so that the online tower's random draws come first in both passes of
        gradient-cached accumulation, which skips it in the second). Every tensor has the batch
        first, so micro-batches concatenate (:mod:`nclip.train.accumulate`)."""
        feats: dict[str, torch.Tensor] = {}
        weak, copy_of = None, None
        if pixels.ndim == 5:
            readers = {head.two_views: head for head in self.heads.values() if head.two_views}
            if not readers or pixels.shape[1] != 2:
                raise ValueError(f"pixels of shape {tuple(pixels.shape)}: two views need a model with a head "
                                 "that reads them ('cmsf' or 'supcon')")
            if "target" in readers:
                pixels, weak, copy_of = pixels[:, 0], pixels[:, 1], readers["target"]
        if pixels.ndim == 5:  # the SupCon family's 2N multi-view batch (Eq. 1): every view through the tower
            b, v = pixels.shape[:2]
            feats["image_views"] = self.vision(pixels.flatten(0, 1)).unflatten(0, (b, v))  # [B, V, d]
        else:
            feats["image"] = self.vision(pixels)
        if self.uses_text and ids.ndim == 3:  # several captions per image
            feats["text"] = self.text(ids.flatten(0, 1), mask.flatten(0, 1)).unflatten(0, ids.shape[:2])
        elif self.uses_text:
            feats["text"] = self.text(ids, mask)
        if weak is not None and target:
            with torch.no_grad():
                feats["image_target"] = copy_of.encode_target(weak)  # the momentum copy, no gradient
        return feats

    def head_outputs(self, feats: dict[str, torch.Tensor]) -> EncoderOutput:
        """The heads' half of :meth:`forward`: the towers' features → what the objective reads."""
        image: dict[str, torch.Tensor] = {}
        for head in self.heads.values():  # the target branch, every view
            image.update(head.from_towers(feats))
        f = feats["image"] if "image" in feats else feats["image_views"][:, 0]
        self._project(f, "image", image, training=True)
        text = self._project_text(feats["text"]) if "text" in feats else {}
        return EncoderOutput(image_features=f, text_features=feats.get("text"), logit_scale=self.scale(),
                             image=image, text=text)

    def _project_text(self, f: torch.Tensor) -> dict[str, torch.Tensor]:
        """The text heads on f [B, d_t], or on f [B, C, d_t] (C captions per image) as one batch of
        B·C rows, their outputs back in [B, C, ...]."""
        if f.ndim == 2:
            return self._project(f, "text", {}, training=True)
        outs = self._project(f.flatten(0, 1), "text", {}, training=True)
        return {key: out.unflatten(0, f.shape[:2]) for key, out in outs.items()}


def _classes(cfg: RunConfig) -> int:
    """The run's class count (the classifier head's width): from the data, asked only by a head that needs it."""
    from nclip.data.labels import run_label_space
    from nclip.objectives.base import class_count

    return class_count(cfg.objective, run_label_space(cfg))


def build_model(cfg: RunConfig, pretrained_text: bool = True) -> DualEncoder:
    """The dual encoder with the heads that the configured objective needs."""
    heads = plan_for(cfg).heads
    return DualEncoder(cfg, heads, pretrained_text=pretrained_text)
