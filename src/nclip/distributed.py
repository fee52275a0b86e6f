"""The one audited place for collectives.

Every global-batch quantity in nclip goes through these functions, because a plain
``dist.all_reduce`` or ``dist.all_gather`` inside a differentiable path is silently wrong:
``all_gather`` drops gradients for the other ranks' rows, and an all-reduce whose backward is the
identity is scaled by 1/world_size once DDP averages the gradients.

Convention (matches DDP): each rank's loss L_r is a mean over its local rows, and DDP averages the
parameter gradients over ranks, so the effective objective is L = mean_r L_r. For a quantity shared
by all ranks the backward of the collective must therefore *sum* the incoming gradients over ranks
(gather) or *average* them (all-reduce-mean); see the derivation in each docstring.

Without an initialised process group (or with world size 1) every function is the identity, so the
single-process code path has no collectives and no overhead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "is_distributed",
    "world_size",
    "rank",
    "gather_with_grad",
    "all_reduce_mean_with_grad",
    "all_reduce_sum_no_grad",
    "all_reduce_mean_no_grad",
    "broadcast_no_grad",
    "all_gather_no_grad",
]


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


class _GatherWithGrad(torch.autograd.Function):
    """Concatenate [B_r, ...] tensors of all ranks along dim 0 (equal B_r on every rank).

    Backward: rank r's rows feed the loss of every rank, so dL/dx_r = sum over ranks of the
    gradient each rank computed for those rows: all-reduce(sum) of the full gradient, then the
    local slice. With DDP's 1/W averaging this yields the gradient of mean_r L_r exactly.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.batch = x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        start = dist.get_rank() * ctx.batch
        return grad[start : start + ctx.batch]


class _AllReduceMeanWithGrad(torch.autograd.Function):
    """mean over ranks of x (same shape everywhere).

    Backward: d(mean_r' L_r')/dx_r = (1/W) sum_r' dL_r'/dmean · (1/W); DDP multiplies what we
    return by 1/W, so we return (1/W) sum_r' g_r' = all-reduce-mean of the incoming gradients.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        out = x.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out / dist.get_world_size()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad / dist.get_world_size()


def gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """[B_local, ...] -> [B_local * W, ...] in rank order, differentiable (see _GatherWithGrad)."""
    return _GatherWithGrad.apply(x) if is_distributed() else x


def all_reduce_mean_with_grad(x: torch.Tensor) -> torch.Tensor:
    """Mean of x over ranks, differentiable and correct under DDP gradient averaging."""
    return _AllReduceMeanWithGrad.apply(x) if is_distributed() else x


@torch.no_grad()
def all_reduce_sum_no_grad(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks of a statistic that carries no gradient (counts, Sinkhorn marginals)."""
    if not is_distributed():
        return x
    out = x.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


@torch.no_grad()
def all_reduce_mean_no_grad(x: torch.Tensor) -> torch.Tensor:
    """Mean over ranks of a statistic that carries no gradient (logged values, centers)."""
    return all_reduce_sum_no_grad(x) / world_size()


@torch.no_grad()
def broadcast_no_grad(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Rank ``src``'s tensor on every rank (prototypes, k-means results)."""
    if is_distributed():
        x = x.contiguous()
        dist.broadcast(x, src=src)
    return x


@torch.no_grad()
def all_gather_no_grad(x: torch.Tensor) -> torch.Tensor:
    """[B, ...] of every rank concatenated along dim 0 in rank order, without gradient (features
    extracted for clustering). Every rank must hold the same shape."""
    if not is_distributed():
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=0)
