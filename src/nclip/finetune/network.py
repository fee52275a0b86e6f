"""The network fine-tuning trains: a checkpoint's image tower and a classifier (xCLIP App. C).

- ``linear``: the tower's pooled feature f (ViT: final-norm [CLS]; conv towers: their pooled map,
  :mod:`nclip.models.towers`) → a linear classifier, zero-initialised (uniform predictions at step 0).
- ``cosine`` (the paper's choice for few labels, CLIP and xCLIP checkpoints): f → the CLIP image
  head (after xCLIP's shared head layers, if any) → g; logits = s · cos(g, w_c), with w_c
  initialised to the class names' text embeddings, prompt-ensembled exactly as zero-shot
  evaluation does (:func:`nclip.eval.features.class_text_outputs`), and s = exp(logit scale)
  learned in pre-training (clamped to 100 as in training). At step 0 its predictions are the
  zero-shot ones; w and s are trained with the rest.

Every logit is computed in float32 (the loss is cross-entropy on them).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from nclip.errors import NclipError
from nclip.models.dual_encoder import LOGIT_SCALE_MAX
from nclip.precision import to_float32

CLASSIFIERS = ("linear", "cosine")


class FinetuneNet(nn.Module):
    """``vision`` (the tower), for ``cosine`` also ``shared`` and ``head`` (the CLIP image head
    path) and ``logit_scale``; ``classifier``: a Linear [d → C] or the cosine weights [C, D]."""

    def __init__(self, model, classifier: str, num_classes: int, class_emb: torch.Tensor | None = None):
        super().__init__()
        if classifier not in CLASSIFIERS:
            raise ValueError(f"classifier must be one of {CLASSIFIERS}, got {classifier!r}")
        self.kind = classifier
        self.vision = model.vision
        if hasattr(self.vision, "patch_dropout"):  # pre-training's FLIP patch dropout: fine-tune on every patch
            self.vision.patch_dropout = 0.0
        if classifier == "cosine":
            if class_emb is None or class_emb.shape[0] != num_classes:
                raise ValueError("the cosine classifier needs one text embedding per class")
            self.shared = model.heads["shared"].image if "shared" in model.heads else nn.Identity()
            self.head = model.heads["clip"].image
            self.classifier = nn.Parameter(F.normalize(class_emb.detach().float(), dim=-1).clone())  # [C, D]
            self.logit_scale = nn.Parameter(model.logit_scale.detach().float().clone())
            self.logit_scale_max = getattr(model, "LOGIT_SCALE_MAX", LOGIT_SCALE_MAX)  # the model's cap (SigLIP's)
        else:
            self.classifier = nn.Linear(model.vision.width, num_classes)
            nn.init.zeros_(self.classifier.weight)
            nn.init.zeros_(self.classifier.bias)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, 3, S, S] → class logits [B, C] (float32)."""
        f = self.vision(pixels)  # [B, d]
        if self.kind == "linear":
            return to_float32(self.classifier(f))
        g = to_float32(self.head(self.shared(f)))  # [B, D]
        scale = self.logit_scale.float().clamp(max=self.logit_scale_max).exp()
        return scale * F.normalize(g, dim=-1) @ F.normalize(self.classifier.float(), dim=-1).T


def has_clip_head(cfg) -> bool:
    from nclip.objectives import plan_for

    return "clip" in plan_for(cfg).heads


def resolve_classifier(choice: str, cfg, fraction: float) -> str:
    """``auto`` → cosine for a checkpoint with a CLIP head fine-tuned on a fraction < 1 of the
    labels (App. C: the CLIP head helps with few labels, not on full data), else linear;
    ``cosine`` on a checkpoint without a CLIP head is a one-line error."""
    clip = has_clip_head(cfg)
    if choice == "auto":
        return "cosine" if clip and fraction < 1 else "linear"
    if choice == "cosine" and not clip:
        raise NclipError(f"--classifier cosine needs a CLIP head, but objective {cfg.objective.name!r} trains none "
                         "(use --classifier linear)")
    return choice


def build_net(ck, classifier: str, space, device) -> FinetuneNet:
    """A fresh :class:`FinetuneNet` from the checkpoint ``ck`` (weights read anew, so every
    learning rate of the sweep starts from the same pre-trained weights) for the classes of
    ``space`` (a LabelKind: names and prompt templates)."""
    from nclip.eval.features import class_text_outputs
    from nclip.objectives.scores import ClipScore

    model = ck.load(device)
    # the cosine classifier is CLIP's zero-shot one, whatever score the objective transfers with
    emb = class_text_outputs(model, space, device, ClipScore())["clip"] if classifier == "cosine" else None
    return FinetuneNet(model, classifier, len(space), emb).to(device)
