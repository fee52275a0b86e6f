"""BatchNorm over the global batch, on every device (CUDA, and CPU/gloo), through the audited collectives.

:class:`GlobalBatchNorm1d` (and ``2d``) computes the batch mean and the (biased) batch variance over
the union of all ranks' rows with :mod:`nclip.distributed`, differentiably, with gradients that are
exact under DDP's gradient averaging (``all_reduce_mean_with_grad``). It is a ``BatchNorm1d``
subclass with the same parameters and buffers, so checkpoints and exported weights are
interchangeable with the plain layer, and it *is* the plain layer whenever there is no process
group, in eval mode, or with world size 1.

Why not ``torch.nn.SyncBatchNorm``: it refuses CPU tensors, so the 2-process gloo test that settles
distributed correctness (docs/design.md) could not run it; and on CUDA its forward indexes with a
boolean mask (the ranks with a non-empty batch), which makes the host wait for the device once per
BatchNorm layer (~110 waits per step for a ResNet-50). This layer reads nothing on the host: the
local row count is known from the shape, the global one stays a device tensor.

Variance is computed about the *global* mean (two small all-reduces of [C] vectors, one after the
other) rather than as E[x²] − E[x]², which cancels catastrophically in float32 when |mean| ≫ std.
"""

from __future__ import annotations

import torch
from torch import nn

from nclip import distributed as collectives
from nclip.models.locking import hold_in_eval, is_held_in_eval

__all__ = ["GlobalBatchNorm1d", "GlobalBatchNorm2d", "convert_sync_batchnorm"]


class _GlobalStats:
    """The forward shared by the 1-d and 2-d layers: statistics over every dim but the channel (1)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and collectives.is_distributed()):
            return super().forward(x)
        dims = tuple(d for d in range(x.ndim) if d != 1)  # [B, C] / [B, C, L] / [B, C, H, W]
        shape = tuple(-1 if d == 1 else 1 for d in range(x.ndim))
        # statistics in (at least) float32 even under bf16 autocast, like cuDNN BN
        x32 = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        n_local = x32.numel() // x32.shape[1]  # a Python int from the shape: no device read
        # rows (× positions) over all ranks, left on the device (float64: exact far beyond 2^24 rows;
        # torch.full fills on the device where torch.tensor would copy a host value over)
        count = torch.full((), n_local, device=x.device, dtype=torch.float64)
        n_total = collectives.all_reduce_sum_no_grad(count)
        n_mean = n_total / collectives.world_size()
        # count-weighted means: mean_r(n_r · m_r) / mean_r(n_r) = Σ n_r m_r / Σ n_r
        mean = collectives.all_reduce_mean_with_grad(x32.mean(dims) * n_local) / n_mean  # [C]
        centred = x32 - mean.view(shape)
        var = collectives.all_reduce_mean_with_grad(centred.pow(2).mean(dims) * n_local) / n_mean  # [C], biased
        y = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats:
            self._track(mean, var, n_total)
        return y.to(x.dtype)

    @torch.no_grad()
    def _track(self, mean: torch.Tensor, var: torch.Tensor, n_total: torch.Tensor) -> None:
        """Running statistics from the global ones (unbiased variance, n/(n − 1)), on the device."""
        self.num_batches_tracked.add_(1)
        if self.momentum is not None:
            factor = self.momentum
        else:  # the cumulative average: 1/t, t read on the device (a lerp weight may be a tensor)
            factor = self.num_batches_tracked.to(self.running_mean.dtype).reciprocal()
        unbiased = var * (n_total / (n_total - 1.0).clamp_min(1.0))
        self.running_mean.lerp_(mean.detach().to(self.running_mean.dtype), factor)
        self.running_var.lerp_(unbiased.detach().to(self.running_var.dtype), factor)


class GlobalBatchNorm1d(_GlobalStats, nn.BatchNorm1d):
    """BatchNorm1d whose training-mode statistics are those of the global batch (all ranks).

    Input [B, C] or [B, C, L]; ranks may hold different B (the statistics are count-weighted).
    Running statistics are updated from the global statistics, identically on every rank.
    """


class GlobalBatchNorm2d(_GlobalStats, nn.BatchNorm2d):
    """BatchNorm2d over the global batch (ResNet towers); see :class:`GlobalBatchNorm1d`."""


_GLOBAL = {nn.BatchNorm1d: GlobalBatchNorm1d, nn.BatchNorm2d: GlobalBatchNorm2d}


def convert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Make every BatchNorm of ``module`` use global-batch statistics; returns the (possibly new)
    root. ``BatchNorm1d``/``2d`` become :class:`GlobalBatchNorm1d`/``2d`` holding the same
    parameters and buffers (the plain layer's state-dict keys), whatever the device (see the module
    docstring for why not ``nn.SyncBatchNorm`` on CUDA)."""
    cls = _GLOBAL.get(type(module))
    if cls is not None:
        ref = module.weight if module.affine else module.running_mean
        kw = {"device": ref.device, "dtype": ref.dtype} if ref is not None else {}
        new = cls(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats, **kw)
        new.load_state_dict(module.state_dict())
        if module.affine:  # a frozen layer stays frozen (CMSF's momentum target branch), as nn.SyncBatchNorm's
            new.weight.requires_grad_(module.weight.requires_grad)
            new.bias.requires_grad_(module.bias.requires_grad)
        new.train(module.training)
        if is_held_in_eval(module):  # a frozen layer's statistics stay frozen (a locked or LoRA-adapted tower)
            hold_in_eval(new)
        return new
    for name, child in module.named_children():
        setattr(module, name, convert_sync_batchnorm(child))
    return module
