"""Helpers shared by the loss families: shape checks, the global batch, paired-logit diagnostics."""

from __future__ import annotations

import torch

from nclip import distributed as collectives


def global_rows(*xs: torch.Tensor, global_batch: bool) -> tuple[list[torch.Tensor], int]:
    """Every rank's rows of each [B, ...] tensor (gathered with gradient, rank order) and the
    offset of this rank's rows in them; the tensors themselves and offset 0 on one process."""
    if global_batch and collectives.is_distributed():
        return [collectives.gather_with_grad(x) for x in xs], collectives.rank() * xs[0].shape[0]
    return list(xs), 0


def check_pair(a: torch.Tensor, b: torch.Tensor, name_a: str, name_b: str) -> None:
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"{name_a} and {name_b} must be 2-D [B, D], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape != b.shape:
        raise ValueError(f"{name_a} {tuple(a.shape)} and {name_b} {tuple(b.shape)} must have the same shape")
    if a.shape[0] == 0:
        raise ValueError("empty batch")



@torch.no_grad()
def pair_logit_stats(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Diagnostics of a [B, N] image→text logit matrix whose row i pairs with column targets[i]:
    ``acc_i2t`` (Acc_C of Tab. B2), mean positive and mean negative logit."""
    pos = logits.gather(1, targets[:, None]).squeeze(1)
    neg = (logits.sum(1) - pos) / max(logits.shape[1] - 1, 1)
    return {
        "acc_i2t": (logits.argmax(1) == targets).float().mean(),
        "logit_pos": pos.mean(),
        "logit_neg": neg.mean(),
    }


@torch.no_grad()
def class_accuracies(pred: torch.Tensor, labels: torch.Tensor,
                     true_labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """``acc`` of class predictions [B] against the training labels and, given the clean labels
    of a noisy-label run, ``clean_acc`` against those (xent, ProtoNW, FrzProto's diagnostics)."""
    out = {"acc": (pred == labels).float().mean()}
    if true_labels is not None:
        out["clean_acc"] = (pred == true_labels).float().mean()
    return out
