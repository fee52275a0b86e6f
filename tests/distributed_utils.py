"""A reusable harness for multi-process (gloo, CPU) tests.

    results = run_ranks(fn, world_size=2, args=(...))

runs ``fn(rank, world_size, *args)`` in ``world_size`` freshly spawned processes that share a gloo
process group (from a file rendezvous, or from torchrun's environment variables through
:func:`nclip.train.launch.setup` with ``init="torchrun"``), and returns the values ``fn`` returned,
in rank order. ``fn`` must be a module-level function (the children import it by name). A failure
on any rank fails the caller with that rank's traceback; a hang fails after ``timeout`` seconds.

For losses, :func:`split_rows` and :func:`compare_with_single_process` implement the check that
settles distributed correctness (docs/design.md): W ranks with 1/W of the batch each must give the
same loss (mean of the per-rank losses) and the same gradients as one process with the whole
batch, under DDP's convention (the effective objective is the mean of the per-rank losses).
"""

from __future__ import annotations

import io
import os
import queue as queue_mod
import socket
import tempfile
import time
import traceback
from typing import Callable

import torch
import torch.multiprocessing as mp


def _child(fn, rank: int, world_size: int, init: str, port: int, init_file: str, args: tuple, results) -> None:
    import torch.distributed as dist

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    torch.set_num_threads(1)
    try:
        if init == "torchrun":  # what torchrun puts in the environment, then nclip's own set-up
            from nclip.config import resolve
            from nclip.train.launch import setup

            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                              LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            ctx = setup(resolve("micro", ["train.device=cpu"]))
            assert ctx.owns_group and (ctx.rank, ctx.world_size) == (rank, world_size), ctx
        else:
            dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        buf = io.BytesIO()  # plain bytes: shared-memory tensors would die with this process
        torch.save(out, buf)
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(fn: Callable, world_size: int = 2, args: tuple = (), timeout: float = 240.0,
              init: str = "file") -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return their results.

    ``init="file"``: the process group comes from a file rendezvous; ``init="torchrun"``: each
    child gets torchrun's environment variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT)
    and :func:`nclip.train.launch.setup` creates the group, as under ``torchrun``."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port() if init == "torchrun" else 0
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_child, args=(fn, r, world_size, init, port, init_file, args, results), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        got: dict[int, object] = {}
        errors: list[str] = []
        try:
            deadline = time.monotonic() + timeout
            while len(got) < world_size and not errors:
                try:
                    rank, status, value = results.get(timeout=1.0)
                except queue_mod.Empty:
                    # a rank that died without reporting (killed, segfault) would otherwise cost the
                    # whole timeout: give up once every unfinished rank is gone
                    dead = [r for r, p in enumerate(procs) if r not in got and not p.is_alive()]
                    if dead and results.empty():
                        codes = ", ".join(f"rank {r}: exit {procs[r].exitcode}" for r in dead)
                        errors.append(f"rank(s) died without a result ({codes})")
                    elif time.monotonic() > deadline:
                        errors.append(f"timed out after {timeout:.0f} s waiting for {world_size - len(got)} rank(s)")
                    continue
                if status == "ok":
                    got[rank] = torch.load(io.BytesIO(value), weights_only=False)  # our own objects
                else:
                    errors.append(f"rank {rank} failed:\n{value}")  # the others may be stuck in a collective
        finally:
            for p in procs:
                p.join(timeout=5 if not errors else 0.5)
                if p.is_alive():
                    p.kill()
                    p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [got[r] for r in range(world_size)]


# --------------------------------------------------------------------------------------------
# losses: W ranks with a slice each against one process with the whole batch
# --------------------------------------------------------------------------------------------


def split_rows(inputs: dict[str, torch.Tensor], row_keys, rank: int, world_size: int,
               leaves=None) -> dict[str, torch.Tensor]:
    """This rank's contiguous slice of the row tensors; shared tensors (scales, biases) whole.
    Every returned tensor is a fresh leaf; those in ``leaves`` (None: all) require grad (labels,
    being integers, cannot)."""
    out = {}
    for k, v in inputs.items():
        if k in row_keys:
            n = v.shape[0] // world_size
            v = v[rank * n : (rank + 1) * n]
        out[k] = v.detach().clone().requires_grad_(leaves is None or k in leaves)
    return out


def loss_and_grads(loss_fn: Callable, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = loss_fn(inputs)
    loss.backward()
    grads = {k: (v.grad.detach().clone() if v.grad is not None else torch.zeros_like(v)) for k, v in inputs.items()}
    return loss.detach(), grads


def only_leaves(result: tuple[torch.Tensor, dict], leaves) -> tuple[torch.Tensor, dict]:
    """A ``loss_and_grads`` result with the gradients of the tensors named in ``leaves`` only."""
    loss, grads = result
    return loss, {k: v for k, v in grads.items() if k in leaves}


def combine_ranks(per_rank: list[tuple[torch.Tensor, dict]], row_keys) -> tuple[torch.Tensor, dict]:
    """The effective loss and gradients of W ranks under DDP's convention: loss = mean of the
    per-rank losses; a row tensor's gradient = its per-rank gradients concatenated / W (DDP's
    averaging of what flows into the parameters); a shared tensor's = the mean of per-rank ones."""
    world = len(per_rank)
    loss = torch.stack([rank_loss for rank_loss, _ in per_rank]).mean()
    grads = {}
    for k in per_rank[0][1]:
        parts = [g[k] for _, g in per_rank]
        grads[k] = torch.cat(parts) / world if k in row_keys else torch.stack(parts).mean(0)
    return loss, grads
