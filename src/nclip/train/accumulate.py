"""Exact gradient accumulation by feature caching, for every objective (``train.accumulation: k``).

Each micro-batch as its own contrastive batch changes the objective: InfoNCE and SigLIP lose
negatives, nCLIP's p̄ and the heads' BatchNorm see B/k rows (BN caps a shared logit near
√((B − m)/m), docs/reproduction.md). Here the objective stays that of the whole global batch, the
GradCache way (Gao et al. 2021), generalised from InfoNCE to objectives whose heads hold batch
statistics by caching the towers' features, not the embeddings:

1. every micro-batch through the towers without gradients, keeping the towers' features (what
   the heads read, ``DualEncoder.tower_features``) and the random state before it;
2. the heads and the objective once, on the features of the whole batch (gathered over the ranks
   by the objective, as without accumulation), with gradients into the cached features: head
   BatchNorm, nCLIP's p̄, InfoNCE and SigLIP negatives, ProtoCLIP's prototypes and targets, CMSF's
   bank queries and ReCo's masks all see the global batch;
3. every micro-batch through the towers again, with gradients and its random state replayed
   (dropout, drop path and patch dropout draw the same as in pass 1), back-propagating its slice
   of the cached features' gradients.

The towers' parameter gradients are then those of one step on the whole batch (the tests check
k = 4 against k = 1 in float64 to 1e-10, for every registered objective, on one process and on 2
ranks). What cannot be whole-batch: statistics *inside* a tower (BatchNorm of the conv-net and
ResNet towers) are per micro-batch, as in any accumulation; the run says so at start-up. The
towers' buffers are put back after pass 1, so that pass 2 updates them once per micro-batch.
CMSF's target tower runs in pass 1 only (it has no gradient). Costs: one more forward of the
towers per step (as gradient checkpointing), and the heads' activations of the whole batch.
"""

from __future__ import annotations

import torch
from torch import nn

from nclip.batch import Batch
from nclip.train.launch import no_grad_sync
from nclip.train.snapshot import BufferSnapshot

# the DualEncoder's trained towers; every other part (the heads, with CMSF's target copy in its head) is a head
TOWERS = ("vision", "text")


def online_towers(model: nn.Module) -> nn.Module:
    """The towers that pass 2 runs again (not CMSF's target tower, held by its head): their buffers
    are put back after pass 1."""
    return nn.ModuleDict({name: getattr(model, name) for name in TOWERS if hasattr(model, name)})


def _rng_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def cached_step(towers: nn.Module, heads: nn.Module, batch: Batch, k: int, tower_buffers: BufferSnapshot,
                device: torch.device, scaled=lambda loss: loss, check=lambda terms: terms) -> dict[str, torch.Tensor]:
    """One step's forward and backward on this rank's ``batch`` in ``k`` micro-batches; returns the
    objective's terms on the whole batch. ``towers``/``heads``: the
    :class:`nclip.train.step.TowerPass`/``HeadPass`` (in DDP under torchrun); ``tower_buffers``:
    a snapshot of :func:`online_towers`; ``scaled``: the loss as back-propagated (fp16: times the loss
    scale, :mod:`nclip.train.loss_scale`; pass 2 then carries the scaled feature gradients); ``check``:
    sees the objective's dict before its backward (:class:`nclip.objectives.contract.FirstStepCheck`)."""
    chunks = batch.chunk(k)
    tower_buffers.take()
    states, cached = [], []
    with torch.no_grad():
        for micro in chunks:  # pass 1
            states.append(_rng_state(device))
            cached.append(towers(micro))
    tower_buffers.restore()  # pass 2 updates the towers' running statistics, once per micro-batch
    feats = {key: torch.cat([c[key] for c in cached]) for key in cached[0]}
    leaves = {key: f.requires_grad_() for key, f in feats.items() if key != "image_target"}
    terms = check(heads(feats, batch))  # the whole batch: DDP averages the heads' gradients after this backward
    scaled(terms["loss"]).backward()
    after_heads = _rng_state(device)
    sizes = [len(micro) for micro in chunks]
    grads = {key: leaf.grad.split(sizes) for key, leaf in leaves.items() if leaf.grad is not None}
    for j, (micro, state) in enumerate(zip(chunks, states)):  # pass 2
        _set_rng_state(state, device)
        with no_grad_sync(towers, skip=j < k - 1):
            out = towers(micro, target=False)
            pairs = [(out[key], grads[key][j]) for key in grads if out[key].requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    _set_rng_state(after_heads, device)
    _count_one_step(tower_buffers.module, k)
    return terms


def _count_one_step(towers: nn.Module, k: int) -> None:
    """A tower BatchNorm's ``num_batches_tracked`` advances once per optimizer step, as without
    accumulation, not once per micro-batch (pass 2 ran k forwards in training mode)."""
    if k > 1:
        for m in towers.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.num_batches_tracked is not None:
                m.num_batches_tracked.sub_(k - 1)
