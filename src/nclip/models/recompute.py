"""Activation recomputation (gradient checkpointing) of the towers: ``model.grad_checkpointing: true``.

A checkpointed piece keeps only its input in the forward and runs again in the backward to get the
activations its gradient needs: less memory for about one more forward of the towers. Always
torch's non-reentrant checkpoint (``use_reentrant=False``): it works when no input requires a
gradient (the pixels), and it saves and restores the RNG state around the recomputation, so
dropout (and anything else that draws) replays the same numbers and the gradients are exactly
those of the plain forward.

The ``transformers`` towers (CLIP ViT, CLIP text, the pretrained MiniLM) use transformers' own
per-layer checkpointing. transformers' ResNet has none (its stem and stages are checkpointed here)
and the conv net is ours (each conv block): both through :func:`checkpoint_once`, which keeps
BatchNorm's running statistics to one update per forward (the recomputation would otherwise update
them a second time). Checkpointing is
only active while training with gradients on: eval and ``no_grad`` forwards are unchanged.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

_BN_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def active(module: nn.Module) -> bool:
    """Whether a forward of ``module`` would be checkpointed now: training, with gradients on."""
    return module.training and torch.is_grad_enabled()


@contextmanager
def _batchnorm_statistics_kept(module: nn.Module):
    """Restore every BatchNorm buffer of ``module`` on exit (also when torch stops a recomputation
    early by raising inside it)."""
    kept = [(buf, buf.clone()) for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
            for name in _BN_BUFFERS if (buf := getattr(m, name, None)) is not None]
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, value in kept:
                buf.copy_(value)


def checkpoint_once(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` under non-reentrant checkpointing, BatchNorm statistics updated once.

    The first call is the forward and updates the running statistics as usual; every later call of
    the same closure is the backward's recomputation, whose updates are undone. (In training mode
    BatchNorm normalises with the batch's statistics, so the recomputed output does not depend on
    the running ones.)"""
    calls = 0

    def run(inp: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == 1:
            return module(inp)
        with _batchnorm_statistics_kept(module):
            return module(inp)

    return checkpoint(run, x, use_reentrant=False)


def enable_hf(model: nn.Module) -> None:
    """transformers' per-layer checkpointing of a ``PreTrainedModel``, non-reentrant (transformers
    then checkpoints each encoder layer while ``training`` and grad-enabled only)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x: the old name warns
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

