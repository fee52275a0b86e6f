"""Will a training step fit in memory? Checked before the first step; a step that runs out is one line.

A batch too large for the machine used to be found by the kernel's OOM killer (exit 137, no word)
after minutes of swapping, or by a CUDA traceback. Before the first step (and before anything is
written to the run directory) :func:`check_step_memory` estimates the step's memory and refuses in one
line, with the largest ``train.batch_size`` that fits, when the estimate passes ``MARGIN`` of the
memory available:

- available: CPU, ``MemAvailable`` of ``/proc/meminfo`` (or the cgroup's ``memory.max`` less
  ``memory.current`` where lower: a container's OOM killer counts that; ``psutil`` where
  ``/proc`` has neither), divided among the ranks of this machine; CUDA, the device's free memory
  (``torch.cuda.mem_get_info``) plus what this process's allocator holds unused. The model's weights
  are already resident then, so only what the step adds is estimated.
- fixed part ``a``: the gradients and the optimizer state of the trainable parameters, from their
  count (AdamW: two moments; SGD: one; 8-bit AdamW: a quarter of those).
- per sample ``b``: the activations that autograd saves for the backward pass, counted exactly by
  ``torch.autograd.graph.saved_tensors_hooks`` (distinct storages, parameters excluded) in a forward
  of the real training step at micro-batches 2 and 4 (``PROBE_BATCHES``), fitted on a line by
  :func:`nclip.bench.batch_memory`'s method (:func:`fit_line`, :func:`largest_batch`, kept here so that
  the bench, a layer above, reuses them), times ``BACKWARD_FACTOR`` for the gradients of the
  activations that the backward allocates while it frees them. (The tiny preset on a CPU saves
  1.93 MiB per sample; ``nclip bench``'s measured peak of whole trainer steps grows by 2.48 MiB per
  sample, 1.28 times that; its fixed part, 97 MiB, against 70 MiB of gradients and AdamW state.)

Cost: nothing when the configured batch is obviously small — the probe runs only when a pessimistic
bound (``PESSIMISTIC_BYTES`` per parameter per sample of the micro-batch, above every model nclip
builds: a ViT-B/16 at 224 saves ~2, the tiny presets 0.1 to 1) passes half the available memory.
Then two forward passes of 2 and 4 samples, no backward: 0.07 s for the micro preset, 0.15 to
0.2 s for a tiny one (batch 128: probed) on two loaded CPU cores (not measured on a GPU). The
probe leaves the run as it found it (buffers, RNG states and the modules' counters are put back):
a run's numbers do not depend on it. Under ``train.compile`` the trainer compiles the step after this
check (:mod:`nclip.train.compile`), so the probe runs eagerly and its batches of 2 and 4 compile no
graph of their own: the compiled step's saved activations are estimated by the eager step's
(Inductor may recompute cheap ones in the backward rather than save them).

What it does not see: terms quadratic in the batch (the B × B logits of a contrastive objective
are a small share below very large batches), the caching allocator's fragmentation, a custom data
source's needs (runs with a custom data source, ProtoCLIP's episodes or the bench's in-memory
batches, are not checked; a probe that fails for any other reason skips the check). Under exact
accumulation the towers' micro-batch is counted (the heads see the whole batch: their share is
small). ``train.memory_check: false`` turns it off.

A step that runs out of memory all the same (``torch.OutOfMemoryError``) becomes one line saying
what to lower (:func:`out_of_memory_message`).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from nclip.batch import Batch
from nclip.errors import NclipError

GIB = 2**30
MARGIN = 0.9  # refuse above this share of the available memory
PROBE_BATCHES = (2, 4)  # micro-batch sizes of the probe (BatchNorm needs more than one row)
BACKWARD_FACTOR = 1.3  # the backward's activation gradients on top of the saved activations
PESSIMISTIC_BYTES = 64  # per parameter per sample: above which the probe runs (module docstring)
_STATE_FLOATS = {"adamw": 2.0, "sgd": 1.0, "adamw8bit": 0.5}  # optimizer state per parameter, in fp32 units


def fit_line(xs: list[float], ys: list[float]) -> dict:
    """Least squares ys ≈ a + b·xs: ``a``, ``b`` and ``residual``, the largest distance of a point
    from the line over the largest point (0: on the line; two points always give 0)."""
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError(f"a line needs two distinct batch sizes, got {xs}")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    worst = max(abs(y - (a + b * x)) for x, y in zip(xs, ys))
    return {"a": a, "b": b, "residual": worst / max(max(abs(y) for y in ys), 1e-12)}


def largest_batch(fixed: float, per_sample: float, limit: float, multiple: int = 1) -> int | None:
    """The largest batch B (a multiple of ``multiple``) with fixed + per_sample·B ≤ limit; 0 where
    not even one fits; None where the fit has no positive slope (memory that does not grow with
    the batch bounds nothing)."""
    if per_sample <= 0:
        return None
    n = math.floor((limit - fixed) / per_sample)
    return max(0, n // multiple * multiple)


def available_bytes(device: torch.device, local_ranks: int = 1) -> tuple[float, str] | None:
    """(bytes a step may still use on ``device``, where the figure comes from); None: unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        spare = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return float(free + spare), f"free on {device}"
    found = _meminfo_available()
    if found is None:
        return None
    avail, where = found
    if local_ranks > 1:
        avail, where = avail / local_ranks, f"{where} / {local_ranks} ranks"
    return avail, where


def _meminfo_available() -> tuple[float, str] | None:
    avail, where = None, ""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail, where = float(line.split()[1]) * 1024, "MemAvailable"
    except OSError:
        pass
    try:  # cgroup v2: the container's limit, which its OOM killer enforces
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            left = float(limit) - float(Path("/sys/fs/cgroup/memory.current").read_text())
            if avail is None or left < avail:
                avail, where = left, "the cgroup's memory.max"
    except (OSError, ValueError):
        pass
    if avail is None:
        try:
            import psutil

            avail, where = float(psutil.virtual_memory().available), "available memory"
        except ImportError:
            return None
    return avail, where


def fixed_bytes(model: torch.nn.Module, objective: torch.nn.Module, optimizer: str) -> float:
    """Gradients and optimizer state of the trainable parameters (the weights are resident already)."""
    params = [p for m in (model, objective) for p in m.parameters() if p.requires_grad]
    grads = sum(p.numel() * p.element_size() for p in params)
    return grads + sum(p.numel() for p in params) * 4 * _STATE_FLOATS.get(optimizer, 2.0)


def saved_bytes(step: torch.nn.Module, batch: Batch) -> int:
    """Bytes of the distinct storages that autograd saves for the backward in a forward of ``step``
    on ``batch``, parameters and buffers excluded (they are resident already)."""
    resident = {t.untyped_storage().data_ptr() for t in (*step.parameters(), *step.buffers())}
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in resident and ptr not in seen:
            seen.add(ptr)
            total += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = step(batch)
    del out
    return total


def probe_batch(model, cfg, n: int, views: int, label_request, device: torch.device,
                slots: tuple[int | None, int | None] | None = None) -> Batch:
    """A stand-in training batch of ``n`` rows, as the step gets it (normalised pixels on the device);
    ``slots``: the run's (caption, negative) slots per image (:func:`nclip.data.loader.slot_counts`,
    which reads a CSV/JSONL file for them: counted here when not given)."""
    from nclip.data.loader import slot_counts

    size = cfg.data.image_size
    pixels = torch.rand(n, *((2,) if views == 2 else ()), 3, size, size, device=device)
    ids, mask = model.tokenizer(["a photo of a thing"] * n)
    batch = Batch(pixels, ids.to(device), mask.to(device))
    captions, negatives = slot_counts(cfg) if slots is None else slots
    if captions is not None:  # data.caption_choice all: every slot through the text tower
        batch.ids, batch.mask = (t[:, None].expand(-1, captions, -1).contiguous() for t in (batch.ids, batch.mask))
        batch.caption_valid = torch.ones(n, captions, dtype=torch.bool, device=device)
    if negatives is not None:  # hard negatives: their slots after the captions
        texts = batch.ids.shape[1] if batch.ids.ndim == 3 else 1
        batch.ids, batch.mask = (t.reshape(n, texts, -1)[:, :1].expand(-1, texts + negatives, -1).contiguous()
                                 for t in (batch.ids, batch.mask))
        batch.negative_valid = torch.ones(n, negatives, dtype=torch.bool, device=device)
    if label_request is not None:
        batch.labels = batch.true_labels = torch.zeros(n, dtype=torch.long, device=device)
        if label_request.frozen is not None:
            batch.index = torch.zeros(n, dtype=torch.long, device=device)
    return batch


def _probe(cfg, learner) -> dict | None:
    """The fit of the saved bytes at ``PROBE_BATCHES``; None when a probe step fails (skip the check)."""
    from nclip.data.loader import slot_counts
    from nclip.objectives import plan_for

    step = learner.step_module
    objective = plan_for(cfg)
    rng = torch.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    counters = [(m, k, v) for m in step.modules() for k, v in vars(m).items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)]
    learner.snapshot.take()
    try:
        sizes = []
        slots = slot_counts(cfg)  # a CSV/JSONL file read once for every probe batch
        for n in PROBE_BATCHES:
            batch = probe_batch(learner.model, cfg, n, objective.views, objective.label_request(), learner.device,
                                slots)
            sizes.append(saved_bytes(step, batch))
        return fit_line(list(PROBE_BATCHES), [float(s) for s in sizes])
    except torch.OutOfMemoryError:
        raise
    except Exception:  # noqa: BLE001 - an input this stand-in batch cannot give: no check rather than no run
        return None
    finally:
        learner.snapshot.restore()
        for m, k, v in counters:
            setattr(m, k, v)
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state_all(rng[1])
        step.zero_grad(set_to_none=True)


def check_step_memory(info, learner, local_ranks: int | None = None) -> None:
    """Refuse in one line a batch whose step would not fit (module docstring); every rank takes the
    decision of the rank with the least room. ``info``: the run's :class:`nclip.train.rundir.RunInfo`;
    ``learner``: its :class:`nclip.train.step.Learner`."""
    from nclip import distributed as collectives

    cfg, ctx = info.cfg, info.ctx
    t = cfg.train
    if not t.memory_check:
        return
    split = ctx.world_size * t.accumulation
    micro = t.batch_size // split
    local_ranks = local_ranks or int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size))
    found = available_bytes(ctx.device, local_ranks if ctx.device.type == "cpu" else 1)
    fixed = fixed_bytes(learner.model, learner.objective, t.optimizer)
    n_params = sum(p.numel() for p in learner.step_module.parameters())
    limit = MARGIN * found[0] if found is not None else math.inf
    near = fixed + micro * PESSIMISTIC_BYTES * n_params > limit / MARGIN / 2
    if collectives.all_reduce_sum_no_grad(torch.tensor([float(near)], device=ctx.device)).item() == 0:
        return
    fit = _probe(cfg, learner)  # on every rank: the objective may gather over them
    need, largest = -1.0, -1.0
    if fit is not None and found is not None:
        per_sample = max(fit["b"], 0.0) * BACKWARD_FACTOR
        base = fixed + max(fit["a"], 0.0)
        need = base + per_sample * micro
        fits = largest_batch(base, per_sample, limit)
        largest = -1.0 if fits is None else float(fits)
    over = torch.tensor([float(need > limit)], device=ctx.device)
    if collectives.all_reduce_sum_no_grad(over).item() == 0:
        return
    if need <= limit:
        raise NclipError("train.batch_size does not fit in the memory of another rank (see its message)")
    raise NclipError(_refusal(t, micro, split, need, found, largest))


def _refusal(t, micro: int, split: int, need: float, found: tuple[float, str], largest: float) -> str:
    per = f" ({micro} per micro-batch)" if split > 1 else ""
    fit = (f"the largest that fits is about train.batch_size={int(largest) * split}" if largest >= 1
           else "not even one sample per micro-batch fits")
    return (f"train.batch_size {t.batch_size}{per} needs about {_size(need)} for a step, more than "
            f"{MARGIN:.0%} of the {_size(found[0])} available ({found[1]}): {fit}; or raise "
            "train.accumulation, or set model.grad_checkpointing=true (estimated from probe steps; "
            "train.memory_check=false skips this check)")


def _size(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2**20:.0f} MiB"


def out_of_memory_message(cfg, device: torch.device, step: int) -> str:
    """The one line for a step that ran out of memory: what to lower."""
    t = cfg.train
    return (f"out of memory on {device} in step {step + 1} (train.batch_size {t.batch_size}, train.accumulation "
            f"{t.accumulation}): lower train.batch_size, raise train.accumulation, set "
            "model.grad_checkpointing=true, or drop patches (model.vision.patch_dropout, e.g. 0.5)")
