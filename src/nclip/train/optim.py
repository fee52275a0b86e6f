"""AdamW (or SGD with momentum) with the usual decay exclusions, and linear warm-up followed by
cosine decay."""

from __future__ import annotations

import math

import torch
from torch import nn

from nclip.config import TrainConfig
from nclip.heads import param_side


def param_groups(modules: list[nn.Module], weight_decay: float) -> list[dict]:
    """Decay only matrices (linear/attention/conv/embedding weights): biases, norms, the logit
    scale and other 0/1-D parameters are excluded, as in CLIP and the xCLIP paper's Tab. F5.

    The first module's (the model's) image tower and image heads form their own groups, tagged
    ``tower: image`` (the rest ``tower: rest``), so that a run can scale their learning rate alone:
    the loop multiplies the scheduled lr by a group's ``lr_scale`` (default 1), and locked-image
    tuning (ProtoCLIP App. A.1, LiT) sets it to 0."""
    buckets: dict[tuple[str, bool], list] = {("rest", True): [], ("rest", False): [],
                                             ("image", True): [], ("image", False): []}
    seen: set[int] = set()
    for i, module in enumerate(modules):
        for name, p in module.named_parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            tower = "image" if i == 0 and param_side(name) == "image" else "rest"  # image tower and heads
            buckets[(tower, p.ndim >= 2)].append(p)
    return [
        {"params": params, "weight_decay": weight_decay if decay else 0.0, "tower": tower}
        for (tower, decay), params in buckets.items()
        if params
    ]


def build_optimizer(modules: list[nn.Module], cfg: TrainConfig) -> torch.optim.Optimizer:
    """``train.optimizer``: AdamW (the default; ``betas``, ``eps``), AdamW with 8-bit moments
    (``adamw8bit``, :mod:`nclip.train.lowbit`) or SGD with heavy-ball momentum ``train.momentum``
    (CMSF Sec. 3 and the authors' code: lr 0.05 at batch 256, momentum 0.9,
    weight decay 1e-4, cosine schedule). All use the decay exclusions of :func:`param_groups`
    (the authors' SGD decays every parameter; excluding biases and norms is the common practice
    since, and the difference is small at wd 1e-4)."""
    groups = param_groups(modules, cfg.weight_decay)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, **_implementation(groups))
    if cfg.optimizer == "adamw8bit":
        from nclip.train.lowbit import adamw8bit

        return adamw8bit(groups, cfg)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, **_implementation(groups))


def _implementation(groups: list[dict]) -> dict:
    """The update kernels: fused (one kernel for every parameter), on CUDA and on the CPU alike.
    The fused AdamW and SGD updates take the step's skip flag on the device (``found_inf``, see
    :mod:`nclip.train.gate`), so a step is skipped without a host read; on the CPU the fused AdamW
    is also ~5x faster than the multi-tensor (``foreach``) update for our towers and agrees with it
    to float rounding (docs/performance.md)."""
    params = [p for g in groups for p in g["params"]]
    if params and all(p.is_floating_point() for p in params) and len({p.device.type for p in params}) == 1:
        return {"fused": True}
    return {"foreach": True}


def set_lr(group: dict, lr: float) -> None:
    """Set a parameter group's learning rate. torchao's optimizers keep it as a tensor, changed in
    place (a new Python float would make their compiled update recompile)."""
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(lr)
    else:
        group["lr"] = lr


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up from lr/warmup to lr,
    then cosine from lr to min_lr at the schedule's last step (``schedule_steps``, else ``steps``),
    then min_lr (the steps an extended run adds, see nclip.train.rundir)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max((cfg.schedule_steps or cfg.steps) - cfg.warmup_steps - 1, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))
