"""One learning rate of the fine-tuning sweep: epochs of AdamW with layer-wise lr decay, warm-up
then cosine, a validation pass after every epoch, the best-validation weights kept, and a
checkpoint per epoch so that a killed run continues where it stopped (``--resume auto``).

Checkpoints are the trainer's (:mod:`nclip.train.checkpoint`: ``LR_DIR/checkpoints/step_E``
after epoch E, safetensors weights + a ``weights_only`` state, written atomically, the last one
kept). Every epoch draws its shuffling, augmentation and drop-path masks from generators seeded by
(seed, lr index, epoch), so a resumed run repeats exactly what an uninterrupted one computes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch.nn import functional as F

from nclip.config import AugmentConfig
from nclip.data.transforms import augment, to_tensor
from nclip.finetune.layers import param_groups
from nclip.jsonio import writing
from nclip.models.drop_path import add_drop_path
from nclip.models.io import atomic_dir
from nclip.train.checkpoint import newest_good_checkpoint, save_checkpoint

BEST = "best"  # LR_DIR/best/model.safetensors: the weights of the best validation epoch
WEIGHTS = "model.safetensors"


@dataclass
class LabelledData:
    """train: raw uint8 images [H, W, 3] and labels [N]; val: eval-preprocessed pixels [M, 3, S, S]
    and labels [M]."""

    train_images: list[np.ndarray]
    train_labels: torch.Tensor
    val_pixels: torch.Tensor
    val_labels: torch.Tensor
    image_size: int


@dataclass
class LrResult:
    lr: float
    best_val: float
    best_epoch: int  # 1-based
    history: list[dict]  # per epoch: loss, val_top1
    best_dir: Path
    drop_path: str  # how drop path was applied (layers.add_drop_path)


@torch.no_grad()
def predict(net, pixels: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    """Class logits [N, C] of eval-preprocessed ``pixels`` [N, 3, S, S], in eval mode."""
    net.eval()
    device = next(net.parameters()).device
    return torch.cat([net(pixels[i:i + batch_size].to(device)).float().cpu()
                      for i in range(0, len(pixels), batch_size)])


def lr_factor(step: int, total: int, warmup: int, base: float, min_lr: float) -> float:
    """Learning rate of step ``step`` (0-based) of ``total``: linear warm-up, then cosine to min_lr."""
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup - 1, 1)
    return min_lr + 0.5 * (base - min_lr) * (1 + math.cos(math.pi * min(progress, 1.0)))


def make_optimizer(net, vision_cfg, settings, lr: float) -> torch.optim.AdamW:
    """AdamW over the layer-wise groups of :func:`nclip.finetune.layers.param_groups`."""
    return torch.optim.AdamW(param_groups(net, vision_cfg, settings.layer_decay, settings.weight_decay), lr=lr)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """Every group at ``lr`` times its layer's ``lr_scale``."""
    for g in opt.param_groups:
        g["lr"] = lr * g["lr_scale"]


def _batches(n: int, size: int, rng: np.random.Generator) -> list[np.ndarray]:
    """A seeded shuffle of ``n`` rows in batches of ``size``; a last batch of one sample joins the
    one before (BatchNorm in training mode needs two)."""
    order = rng.permutation(n)
    out = [order[i:i + size] for i in range(0, n, size)]
    if len(out) > 1 and len(out[-1]) == 1:
        out[-2:] = [np.concatenate(out[-2:])]
    return out


def run_lr(make_net: Callable[[], torch.nn.Module], vision_cfg, lr: float, index: int, data: LabelledData,
           settings, lr_dir: Path, log: Callable[[str], None]) -> LrResult:
    """Fine-tune a fresh network at learning rate ``lr`` (the ``index``-th of the sweep) for
    ``settings.epochs``, continuing from ``lr_dir``'s newest checkpoint if there is one."""
    net = make_net()
    drop = add_drop_path(net.vision, settings.drop_path)
    opt = make_optimizer(net, vision_cfg, settings, lr)
    aug = AugmentConfig()
    n = len(data.train_images)
    steps_per_epoch = len(_batches(n, settings.batch_size, np.random.default_rng(0)))
    total = steps_per_epoch * settings.epochs
    warmup = int(round(settings.warmup_epochs * steps_per_epoch))
    start, best_val, best_epoch, history = 0, -1.0, 0, []
    found = newest_good_checkpoint(lr_dir, warn=log)
    if found is not None:
        _, weights, state = found
        net.load_state_dict(weights)
        opt.load_state_dict(state["optimizer"])
        start, best_val, best_epoch = int(state["step"]), float(state["best_val"]), int(state["best_epoch"])
        history = list(state["history"])
        if start < settings.epochs:
            log(f"lr {lr:g}: resuming after epoch {start}")
    device = next(net.parameters()).device
    for epoch in range(start, settings.epochs):
        torch.manual_seed(_seed(settings.seed, index, epoch))  # drop-path masks
        rng = np.random.default_rng([settings.seed, index, epoch])
        net.train()
        losses = []
        for b, rows in enumerate(_batches(n, settings.batch_size, rng)):
            step = epoch * steps_per_epoch + b
            set_lr(opt, lr_factor(step, total, warmup, lr, settings.min_lr))
            pixels = torch.stack([to_tensor(augment(data.train_images[i], data.image_size, aug, rng)) for i in rows])
            logits = net(pixels.to(device))  # float32
            loss = F.cross_entropy(logits, data.train_labels[rows].to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        val = float((predict(net, data.val_pixels).argmax(1) == data.val_labels).float().mean())
        history.append({"epoch": epoch + 1, "loss": float(np.mean(losses)), "val_top1": val})
        log(f"lr {lr:g} epoch {epoch + 1}/{settings.epochs}: loss {history[-1]['loss']:.4f}, "
            f"val top-1 {100 * val:.1f}%")
        if val > best_val:
            best_val, best_epoch = val, epoch + 1
            with writing(lr_dir / BEST), atomic_dir(lr_dir / BEST) as tmp:  # a full disk: one line
                save_file(_weights(net), str(tmp / WEIGHTS), metadata={"format": "nclip-finetune"})
        save_checkpoint(lr_dir, epoch + 1, _weights(net),
                        {"optimizer": opt.state_dict(), "best_val": best_val, "best_epoch": best_epoch,
                         "history": history, "lr": lr}, keep=1)
    return LrResult(lr, best_val, best_epoch, history, lr_dir / BEST, drop)


def load_best(net: torch.nn.Module, best_dir: Path) -> torch.nn.Module:
    net.load_state_dict(load_file(str(best_dir / WEIGHTS)))
    return net


def _weights(net) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous().cpu() for k, v in net.state_dict().items()}


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])
