"""GlobalBatchNorm (model.sync_batchnorm): 2 gloo ranks holding different batch sizes give the
plain BatchNorm of the whole batch (outputs, gradients, running statistics), with no host read in
the forward or backward; the converter uses it on every device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nclip.models.sync_batchnorm import GlobalBatchNorm1d, GlobalBatchNorm2d, convert_sync_batchnorm

from distributed_utils import run_ranks
from host_syncs import SYNC_OPS

ROWS = (3, 5)  # rank 0 and rank 1: unequal, so only count-weighted statistics are right
SHAPES = {"1d": (4,), "1d-seq": (4, 3), "2d": (4, 3, 2)}  # [B, C], [B, C, L], [B, C, H, W] after B
MOMENTA = (0.1, None)  # None: the cumulative average 1/t


def _layer(kind: str, momentum: float | None) -> nn.Module:
    cls = nn.BatchNorm2d if kind == "2d" else nn.BatchNorm1d
    torch.manual_seed(0)
    bn = cls(SHAPES[kind][0], momentum=momentum).double()
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return bn


def _inputs(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(ROWS), *SHAPES[kind], generator=g, dtype=torch.float64) * 3 + 2
    w = torch.randn(x.shape, generator=g, dtype=torch.float64)  # the loss: Σ w·y over rows
    return x, w


def _run(bn: nn.Module, x: torch.Tensor, w: torch.Tensor, scale: float, steps: int = 2) -> dict:
    """``steps`` forwards (the running statistics move twice) and a backward of the last one."""
    x = x.detach().clone().requires_grad_(True)
    for _ in range(steps):
        y = bn(x)
    (scale * (w * y).sum()).backward()
    return {"y": y.detach(), "x.grad": x.grad, "weight.grad": bn.weight.grad, "bias.grad": bn.bias.grad,
            **{k: v.clone() for k, v in bn.state_dict().items()}}


def _rank(rank: int, world: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    out = {}
    start = sum(ROWS[:rank])
    rows = slice(start, start + ROWS[rank])
    for kind in SHAPES:
        for momentum in MOMENTA:
            bn = convert_sync_batchnorm(_layer(kind, momentum))
            x, w = _inputs(kind)
            # DDP's convention: the effective loss is the mean of the ranks' losses, so rank r's
            # loss is W/N · Σ its rows (mean over ranks = the whole batch's mean)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                got = _run(bn, x[rows], w[rows], world / sum(ROWS))
            got["reads"] = sorted({e.name for e in prof.events() if e.name in SYNC_OPS})
            got["type"] = type(bn).__name__
            out[(kind, momentum)] = got
    return out


@pytest.mark.slow
def test_two_ranks_with_different_batch_sizes_equal_one_batchnorm_on_the_whole_batch():
    ranks = run_ranks(_rank, world_size=2, timeout=240)
    for kind in SHAPES:
        for momentum in MOMENTA:
            x, w = _inputs(kind)
            want = _run(_layer(kind, momentum), x, w, 1 / sum(ROWS))
            got = [r[(kind, momentum)] for r in ranks]
            case = f"{kind}, momentum {momentum}"
            assert [g["type"] for g in got] == [("GlobalBatchNorm2d" if kind == "2d" else "GlobalBatchNorm1d")] * 2
            assert all(not g["reads"] for g in got), (case, [g["reads"] for g in got])
            torch.testing.assert_close(torch.cat([g["y"] for g in got]), want["y"], rtol=1e-12, atol=1e-12, msg=case)
            # an input's gradient comes back W times its share (DDP averages parameter gradients only)
            torch.testing.assert_close(torch.cat([g["x.grad"] for g in got]) / 2, want["x.grad"],
                                       rtol=1e-10, atol=1e-12, msg=case)
            for key in ("weight.grad", "bias.grad"):  # DDP's average over ranks
                torch.testing.assert_close((got[0][key] + got[1][key]) / 2, want[key], rtol=1e-10, atol=1e-12,
                                           msg=f"{case}: {key}")
            for key in ("running_mean", "running_var", "num_batches_tracked"):
                for g in got:
                    torch.testing.assert_close(g[key], want[key], rtol=1e-12, atol=1e-12, msg=f"{case}: {key}")


def test_the_converter_uses_global_batchnorm_on_every_device():
    """No nn.SyncBatchNorm on CUDA either (its boolean-mask indexing waits for the device once per
    layer): the converter takes no device, so nothing in it can choose another layer for CUDA."""
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2), nn.BatchNorm1d(2))
    model[4].requires_grad_(False)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    converted = convert_sync_batchnorm(model)
    assert [type(m) for m in converted if "BatchNorm" in type(m).__name__] == [GlobalBatchNorm2d, GlobalBatchNorm1d]
    assert not any(isinstance(m, nn.SyncBatchNorm) for m in converted.modules())
    assert converted.state_dict().keys() == state.keys()
    assert all(torch.equal(converted.state_dict()[k], v) for k, v in state.items())
    assert not converted[4].weight.requires_grad and converted[1].weight.requires_grad  # frozen stays frozen
