"""What every objective sees (EncoderOutput) and returns (a loss plus named terms)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn


@dataclass
class EncoderOutput:
    """The dual encoder's outputs for one batch of B pairs.

    image_features, text_features: backbone features f_I [B, d_img], f_T [B, d_txt].
    image_emb, text_emb: CLIP-head outputs g [B, D], or None when the model has no CLIP head.
    image_logits, text_logits: nCLIP-head outputs h [B, K], or None without an nCLIP head.
    logit_scale: the InfoNCE multiplier 1/σ = exp(s), already clamped (scalar tensor).
    image_proto, text_proto: ProtoCLIP projection-head outputs [B, d_h] (not normalised), computed
        from the CLIP embeddings; None without a "proto" head.
    """

    image_features: torch.Tensor
    text_features: torch.Tensor
    image_emb: torch.Tensor | None
    text_emb: torch.Tensor | None
    image_logits: torch.Tensor | None
    text_logits: torch.Tensor | None
    logit_scale: torch.Tensor
    image_proto: torch.Tensor | None = None
    text_proto: torch.Tensor | None = None


class ObjectiveConfig(BaseModel):
    """Base of every objective's typed config: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    global_batch: bool = True  # compute batch statistics over all ranks when distributed


class Objective(nn.Module):
    """A loss module: holds state (queues, centers, learnable biases) and reports named terms.

    ``forward`` returns a dict with the scalar ``loss`` to minimise and any number of other scalar
    terms to log (detached or not; the trainer detaches them). The trainer never knows which
    objective it runs.
    """

    heads: ClassVar[frozenset[str]]  # which projection heads the model must build: clip, nclip, proto
    zero_shot_head: ClassVar[str]  # the head used for zero-shot transfer (paper's default)
    # True: trained by nclip.train.episodic (per-episode prototypes; forward takes per-row targets)
    episodic: ClassVar[bool] = False

    def forward(self, out: EncoderOutput) -> dict[str, torch.Tensor]:  # pragma: no cover
        raise NotImplementedError
