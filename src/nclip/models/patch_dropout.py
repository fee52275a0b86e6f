"""Patch dropout (FLIP, Li et al. 2023): the ViT image tower sees a random subset of its patches.

``model.vision.patch_dropout: p`` -- while training, each image keeps its [CLS] token and
round((1 − p)·N) of its N patch tokens, drawn independently per image after the patch and position
embeddings (so each kept token still knows where it was); the encoder then runs on 1 + (1 − p)·N
tokens, which is where the speed-up comes from (FLIP: about 2x and 4x fewer encoder FLOPs at p = 0.5
and 0.75). In
eval mode every token is kept. ``train.unmasked_steps: n`` trains the last n steps with every patch
(FLIP's "unmasked tuning"), which closes most of the gap between masked training and
unmasked evaluation.

The draw uses torch's default generator of the tokens' device, so the trainer's saved RNG state
makes resume exact, each rank draws from its own seeded state, and restoring the RNG state before
a second pass over the same micro-batch drops the same tokens.

The trainer calls :func:`patch_dropout_at` and :func:`set_patch_dropout` before every step.
"""

from __future__ import annotations

import torch
from torch import nn

from nclip.config import RunConfig


def kept_patches(n: int, p: float) -> int:
    """Patch tokens an image keeps out of ``n`` at rate ``p``: round((1 − p)·n), at least one."""
    return max(1, round((1 - p) * n))


def drop_patches(tokens: torch.Tensor, p: float) -> torch.Tensor:
    """tokens [B, 1 + N, D] ([CLS] first) → [B, 1 + round((1 − p)·N), D]: [CLS] and a random subset
    of each image's patch tokens (uniform without replacement, per image, as FLIP)."""
    if p <= 0:
        return tokens
    b, n, d = tokens.shape[0], tokens.shape[1] - 1, tokens.shape[2]
    scores = torch.rand(b, n, device=tokens.device)  # [B, N], the device's default generator
    keep = scores.topk(kept_patches(n, p), dim=1).indices  # [B, K]
    patches = tokens[:, 1:].gather(1, keep.unsqueeze(-1).expand(-1, -1, d))  # [B, K, D]
    return torch.cat([tokens[:, :1], patches], dim=1)


def patch_dropout_at(cfg: RunConfig, step: int) -> float:
    """The patch-dropout rate of the 0-based optimizer ``step``: ``model.vision.patch_dropout``,
    then 0 for the last ``train.unmasked_steps`` steps of ``train.steps`` (FLIP's unmasked tuning).
    A pure function of the step, like the lr schedule, so resume recomputes it."""
    if step >= cfg.train.steps - cfg.train.unmasked_steps:
        return 0.0
    return cfg.model.vision.patch_dropout


def set_patch_dropout(model: nn.Module, p: float) -> None:
    """Set the rate of the model's image tower (a :class:`DualEncoder`, or one wrapped by DDP:
    its ``module``). Only the trained tower: CMSF's momentum target keeps every token. Rate 0 on a
    tower without patch dropout (resnet, convnet) does nothing; another rate is a ``ValueError``."""
    model = getattr(model, "module", model)
    if not 0 <= p < 1:
        raise ValueError(f"patch dropout rate must lie in [0, 1), got {p}")
    if hasattr(model.vision, "patch_dropout"):
        model.vision.patch_dropout = float(p)
    elif p:
        raise ValueError(f"the {model.vision.kind} image tower has no patch dropout (model.vision.kind vit has)")
