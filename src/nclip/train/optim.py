"""AdamW with the usual decay exclusions, and linear warm-up followed by cosine decay."""

from __future__ import annotations

import math

import torch
from torch import nn

from nclip.config import TrainConfig


def param_groups(modules: list[nn.Module], weight_decay: float) -> list[dict]:
    """Decay only matrices (linear/attention/conv/embedding weights): biases, norms, the logit
    scale and other 0/1-D parameters are excluded, as in CLIP and the xCLIP paper's Tab. F5."""
    decay, no_decay, seen = [], [], set()
    for module in modules:
        for p in module.parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(modules: list[nn.Module], cfg: TrainConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(modules, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up from lr/warmup to lr,
    then cosine from lr to min_lr at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps - 1, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))
