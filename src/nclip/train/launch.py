"""Distributed launch: the process group from torchrun's environment, and model wrapping.

``torchrun --nproc-per-node N -m nclip train ...`` starts N processes with ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` and the rendezvous address in their environment; :func:`setup`
turns that into a process group (NCCL on GPUs, gloo on CPU) and a device per process. Without
those variables (or with ``WORLD_SIZE=1``) nothing is initialised and the single-process path has
no collectives at all. A process group created by the caller (tests, notebooks) is used as it is
and left alone at the end.

Wrapping (:func:`wrap`): the model and the objective are run as one module
(:class:`nclip.train.step.TrainStep`), so that the objective's own parameters (learnable biases,
prototypes) are averaged like the towers'.

- ``train.strategy: ddp`` — DistributedDataParallel: every rank holds the full model, gradients
  are averaged over ranks (the convention that :mod:`nclip.distributed` is written against).
- ``train.strategy: fsdp`` — FSDP2 (``torch.distributed.fsdp.fully_shard``): every entry of the
  towers' layer lists and every side of every head of the model is its own shard unit, then the root
  (0-d parameters such as the logit scale stay replicated, see :func:`sync_replicated_grads`); parameters,
  gradients and optimizer state are sharded over ranks. Gradients are averaged exactly like DDP's,
  so the objectives need no change. Works with gloo on CPU as well (tested on 2 ranks).
- ``model.sync_batchnorm`` — every BatchNorm of the model *and* the objective (the nCLIP and
  ProtoCLIP heads, and a ResNet image tower's BatchNorm2d) computes its statistics over the global
  batch: :class:`nclip.models.sync_batchnorm.GlobalBatchNorm1d`/``2d`` on every device (not
  ``nn.SyncBatchNorm``: it refuses CPU tensors, and on CUDA it waits for the device once per layer,
  see that module). We convert the whole module rather than
  only the heads so that a BatchNorm added anywhere later is covered too; transformer towers use
  LayerNorm and are unaffected.

DDP does not re-broadcast buffers at every forward (``forward_sync_buffers=False``, formerly
``broadcast_buffers=False``): BatchNorm running statistics are already identical on
every rank (global statistics), and objective buffers (queues, centers) must be kept identical by
the objective through :mod:`nclip.distributed`; rank 0's copies are the ones checkpointed.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from nclip.config import RunConfig
from nclip.errors import NclipError
from nclip.models.sync_batchnorm import convert_sync_batchnorm

__all__ = ["DistContext", "setup", "teardown", "wrap", "ddp", "no_grad_sync", "sync_replicated_grads",
           "full_state_dict"]


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    owns_group: bool = False  # we created the process group, so we destroy it

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _device(cfg: RunConfig, local_rank: int) -> torch.device:
    want = cfg.train.device
    if want == "cuda" and not torch.cuda.is_available():
        raise NclipError("train.device is 'cuda' but no CUDA device is available")
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if local_rank >= torch.cuda.device_count():
            raise NclipError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} CUDA devices are visible")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _use(device: torch.device) -> torch.device:
    """Make a CUDA ``device`` the current one: what runs on ``cuda`` without an index (NCCL's
    communicators, a library's own allocations, the RNG state a checkpoint saves) goes to this
    rank's GPU rather than GPU 0."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def setup(cfg: RunConfig) -> DistContext:
    """Initialise the process group from torchrun's environment (if any) and pick this rank's device."""
    if dist.is_available() and dist.is_initialized():  # created by the caller
        rank, world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", rank if world > 1 else 0))
        device = _use(_device(cfg, local if torch.cuda.is_available() else 0))
        return DistContext(rank, world, local, device, owns_group=False)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistContext(device=_use(_device(cfg, 0)))
    for key in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if key not in os.environ:
            raise NclipError(f"WORLD_SIZE={world} but {key} is not set; launch with torchrun")
    local = int(os.environ["LOCAL_RANK"])
    device = _use(_device(cfg, local))
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(minutes=30)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")  # set by torchrun's agent
    group = {} if restart is None else dict(store=_attempt_store(timeout, restart), rank=int(os.environ["RANK"]),
                                             world_size=world)
    dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None, **group)
    return DistContext(dist.get_rank(), dist.get_world_size(), local, device, owns_group=True)


def _attempt_store(timeout: datetime.timedelta, restart: str):
    """torchrun's store (env://, as init_process_group would open it), its keys under a prefix of this
    restart's own. torchrun's agent keeps one store across the restarts of a job, so without the prefix
    a restarted rank can read the address a killed worker published and fail, or hang, connecting to it
    (gloo's "connectFullMesh failed ... Connection refused")."""
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    return dist.PrefixStore(f"nclip/attempt_{restart}", store)


def teardown(ctx: DistContext) -> None:
    """Destroy the process group if :func:`setup` created it."""
    if ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def find_unused(cfg: RunConfig) -> bool:
    # a pretrained BERT-style text tower pooled by mean/[CLS] never uses its pooler layer; ProtoCLIP's
    # lit_episode locks the image side during the run (nclip.models.locking): no gradient from then on
    return (cfg.model.text.kind == "pretrained" and cfg.model.text.pooling != "pooler"
            or getattr(cfg.objective, "lit_episode", None) is not None)


def cached_accumulation(cfg: RunConfig) -> bool:
    """Does the run accumulate by gradient caching (:mod:`nclip.train.accumulate`)?"""
    return cfg.train.accumulation > 1 and cfg.train.accumulation_mode == "exact"


def ddp(module: nn.Module, ctx: DistContext, find_unused: bool) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    no_sync_buffers = ({"forward_sync_buffers": False}
                       if "forward_sync_buffers" in inspect.signature(DDP).parameters
                       else {"broadcast_buffers": False})
    return DDP(module, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
               find_unused_parameters=find_unused, **no_sync_buffers)


def wrap(step: nn.Module, ctx: DistContext, cfg: RunConfig) -> nn.Module:
    """The module the loop calls: ``step`` itself on one process, else DDP or FSDP2 around it.
    With gradient-cached accumulation the step stays unwrapped: :func:`nclip.train.step.wrap_passes`
    wraps its two halves instead."""
    if not ctx.distributed:
        return step
    if cfg.model.sync_batchnorm:
        convert_sync_batchnorm(step)
    if cached_accumulation(cfg):
        return step
    if cfg.train.strategy == "ddp":
        return ddp(step, ctx, find_unused(cfg))
    from torch.distributed.fsdp import fully_shard

    # FSDP2 cannot shard 0-d parameters (the logit scale, SigLIP's bias): they stay replicated and
    # their gradients are averaged by sync_replicated_grads, as DDP would
    scalars = {p for p in step.parameters() if p.ndim == 0}
    for module in list(step.modules()):
        if isinstance(module, nn.ModuleList):  # transformer layers of both towers
            for layer in module:
                if any(True for _ in layer.parameters()):
                    fully_shard(layer, ignored_params=scalars)
    for head in step.model.heads.values():  # each side of a projection head (the nCLIP ones are large)
        for name, part in head.named_children():
            if name not in head.towers() and any(True for _ in part.parameters()):
                fully_shard(part, ignored_params=scalars)
    fully_shard(step, ignored_params=scalars)
    # in registration order, the same on every rank (a set's order is not)
    step._nclip_replicated = [p for p in step.parameters() if p.ndim == 0 and not hasattr(p, "device_mesh")]
    return step


def sync_replicated_grads(module: nn.Module) -> None:
    """Average over ranks the gradients of the parameters FSDP2 left replicated (after backward of
    the last micro-batch; a no-op for DDP and one process)."""
    params = getattr(module, "_nclip_replicated", None)
    if not params or not dist.is_initialized():
        return
    flat = torch.stack([p.grad.reshape(()) if p.grad is not None else torch.zeros((), device=p.device, dtype=p.dtype)
                        for p in params])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= dist.get_world_size()
    for p, g in zip(params, flat):
        if p.grad is None:
            p.grad = g.clone().reshape(p.shape)
        else:
            p.grad.copy_(g.reshape(p.shape))


def unwrap(module: nn.Module) -> nn.Module:
    """The training step inside DDP (FSDP2 shards the module in place: it is its own)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return module.module if isinstance(module, DDP) else module


@contextlib.contextmanager
def no_grad_sync(module: nn.Module, skip: bool):
    """Suppress the gradient all-reduce for the micro-batches before the last (accumulation)."""
    if not skip:
        yield
        return
    if hasattr(module, "no_sync"):  # DDP
        with module.no_sync():
            yield
    elif hasattr(module, "set_requires_gradient_sync"):  # FSDP2
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
    else:
        yield


def is_fsdp(module: nn.Module) -> bool:
    return hasattr(module, "set_requires_gradient_sync")


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The TrainStep's full (unsharded) state dict on CPU; under FSDP a collective, full on rank 0
    only (other ranks get an empty dict)."""
    if is_fsdp(module):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu() for k, v in unwrap(module).state_dict().items()}


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[str, dict]:
    """(format, state): ``ids`` (the optimizer's own state dict) or, under FSDP, ``fqn`` (full,
    keyed by parameter names; a collective, full on rank 0 only)."""
    if is_fsdp(module):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        return "fqn", get_optimizer_state_dict(module, optimizer,
                                               options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return "ids", optimizer.state_dict()


def load_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, fmt: str, state: dict) -> None:
    want = "fqn" if is_fsdp(module) else "ids"
    if fmt != want:
        strategy = {"fqn": "fsdp", "ids": "ddp (or one process)"}[fmt]
        raise NclipError(f"the checkpoint's optimizer state was written with train.strategy {strategy}; "
                         "resume with that strategy")
    if want == "fqn":
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(full_state_dict=True))
    else:
        optimizer.load_state_dict(state)
