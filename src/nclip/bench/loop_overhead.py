"""Trainer over hand loop: the real training loop (:func:`nclip.train.loop.train`, what ``nclip
train`` runs) against a minimal hand-written loop, on the same model, batch and optimizer.

Both loops get one real batch of the run's data, built once and kept in memory, so the data loader
is out of the comparison; what remains is what the trainer adds around forward, backward and the
optimizer step (the lr schedule, the non-finite guard, the gradient norm, the logged terms,
metrics.jsonl, the counters). The hand loop is what a user would write:

    out = model(pixels, ids, mask)            # under the run's autocast
    loss = objective(to_float32(out))["loss"]
    loss.backward(); optimizer.step(); optimizer.zero_grad(set_to_none=True)

Each loop builds its model from the same seed and runs ``warmup + steps`` steps; the timed window
spans steps ``warmup`` to ``warmup + steps - 1`` (for the trainer: the times at which it asks its
data source for the next batch, so the model build, the first steps and the final checkpoint are
outside it). Repeats alternate hand, trainer, hand, trainer, ... and the ratio is the median of the
per-repeat ratios, which a loaded machine disturbs less than either time alone.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from nclip.config import RunConfig
from nclip.data.loader import train_loader
from nclip.models import build_model
from nclip.objectives import REGISTRY, build_objective
from nclip.precision import autocast_dtype, to_float32, tower_autocast
from nclip.train.labels import label_space_for
from nclip.train.launch import TrainStep
from nclip.train.optim import build_optimizer


def one_batch(cfg: RunConfig) -> tuple[torch.Tensor, ...]:
    """The run's first training batch (pixels, ids, mask, *rows), as the trainer's loader makes it."""
    objective = REGISTRY[cfg.objective.name][1]
    model = build_model(cfg, pretrained_text=False)
    data = train_loader(cfg, model.tokenizer, views=objective.views, labels=objective.label_request(cfg))
    return tuple(next(iter(data)))


def device_of(cfg: RunConfig) -> torch.device:
    want = cfg.train.device
    return torch.device("cuda" if want != "cpu" and torch.cuda.is_available() else "cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_parts(cfg: RunConfig, device: torch.device):
    """Model, objective and optimizer as the trainer builds them (same threads, seed and order)."""
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg)
    objective = build_objective(cfg.objective, cfg, label_space=label_space_for(cfg))
    model.to(device)
    objective.to(device)
    return model, objective, build_optimizer([model, objective], cfg.train)


def hand_loop(cfg: RunConfig, batch: tuple, warmup: int, steps: int) -> tuple[float, float]:
    """(wall, process CPU) seconds per step of the minimal loop (module docstring)."""
    device = device_of(cfg)
    model, objective, optimizer = build_parts(cfg, device)
    amp = autocast_dtype(cfg.train.precision, device)
    pixels, ids, mask, *rows = (x.to(device) for x in batch)
    model.train()
    objective.train()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    clip = cfg.train.grad_clip
    t0 = (0.0, 0.0)
    for i in range(warmup + steps):
        if i == warmup:
            t0 = _now(device)
        with tower_autocast(device, amp):
            out = model(pixels, ids, mask)
        loss = objective(to_float32(out), *rows)["loss"]
        loss.backward()
        if clip:  # part of the recipe, not of the trainer: the hand loop clips as well
            torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return _per_step(t0, _now(device), steps)


def _now(device: torch.device) -> tuple[float, float]:
    """(wall, process CPU) seconds, after the device's queued work."""
    _sync(device)
    return time.perf_counter(), time.process_time()


def _per_step(t0: tuple[float, float], t1: tuple[float, float], steps: int) -> tuple[float, float]:
    return (t1[0] - t0[0]) / steps, (t1[1] - t0[1]) / steps


class _Stamped:
    """A data source for :func:`nclip.train.loop.train` that yields one in-memory batch every step
    and notes the time of every request (the trainer's data-source interface: ``skipped``,
    ``state()``, iteration)."""

    skipped = 0

    def __init__(self, batch: tuple, steps: int, stamps: list, device: torch.device):
        self.batch, self.steps, self.stamps, self.device = batch, steps, stamps, device

    def state(self) -> dict:
        return {"kind": "map", "skipped": 0}

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        for _ in range(self.steps):
            self.stamps.append(_now(self.device))
            yield self.batch


def trainer_loop(cfg: RunConfig, batch: tuple, warmup: int, steps: int) -> tuple[float, float]:
    """(wall, process CPU) seconds per step of :func:`nclip.train.loop.train` over ``batch`` (module docstring)."""
    from nclip.train.loop import train

    total = warmup + steps + 1  # the last step ends with the final checkpoint: outside the window
    # only the final checkpoint, after the window
    t = cfg.train.model_copy(update={"steps": total, "schedule_steps": None, "checkpoint_every": total,
                                     "keep_checkpoints": 1})
    run_cfg = cfg.model_copy(update={"train": t})
    stamps: list[float] = []
    device = device_of(cfg)

    def source(**kw):
        return _Stamped(batch, total, stamps, device)

    with tempfile.TemporaryDirectory(prefix="nclip-bench-") as tmp:
        train(run_cfg, Path(tmp) / "run", progress=False, evaluate=False, data_source=source)
    return _per_step(stamps[warmup], stamps[warmup + steps], steps)


def steps_for(seconds_per_step: float, window_s: float, lo: int = 5, hi: int = 400) -> int:
    """Steps that fill about ``window_s`` seconds."""
    return max(lo, min(hi, int(window_s / max(seconds_per_step, 1e-6)) + 1))


def trainer_over_hand(cfg: RunConfig, repeats: int = 3, window_s: float = 0.4, warmup: int = 3) -> dict:
    """The trainer's speed as a share of the hand loop's (hand step time / trainer step time: 1 is
    no overhead), the median over interleaved repeats, with both loops' median step times.

    The clock: wall time on a GPU; on the CPU the process's CPU time (``clock: cpu``), since on a
    shared machine the wall time mostly measures the other processes (both are reported)."""
    batch = one_batch(cfg)
    device = device_of(cfg)
    clock = 0 if device.type == "cuda" else 1
    # one untimed pass of each loop first: the process's first steps (allocator, lazy init, thread
    # pools) are several times slower and would land in the first repeat
    trainer_loop(cfg, batch, warmup=1, steps=1)
    hand_loop(cfg, batch, warmup=1, steps=1)
    pilot = hand_loop(cfg, batch, warmup=1, steps=2)
    steps = steps_for(pilot[0], window_s)
    hand, trainer = [], []
    for _ in range(repeats):
        hand.append(hand_loop(cfg, batch, warmup, steps))
        trainer.append(trainer_loop(cfg, batch, warmup, steps))
    ratios = [h[clock] / t[clock] for h, t in zip(hand, trainer)]
    wall = [h[0] / t[0] for h, t in zip(hand, trainer)]
    return {"ratio": statistics.median(ratios), "clock": ("wall", "cpu")[clock],
            "ratio_wall": statistics.median(wall), "ratios": ratios,
            "hand_step_s": statistics.median(h[0] for h in hand),
            "trainer_step_s": statistics.median(t[0] for t in trainer),
            "steps": steps, "repeats": repeats}


def step_flops(cfg: RunConfig, batch: tuple) -> int:
    """FLOPs of one training step's forward and backward (``FlopCounterMode``: matmuls and
    convolutions; the optimizer's element-wise update is not counted, as in the usual MFU)."""
    from torch.utils.flop_counter import FlopCounterMode

    device = device_of(cfg)
    model, objective, _ = build_parts(cfg, device)
    step = TrainStep(model, objective, autocast_dtype(cfg.train.precision, device))
    pixels, ids, mask, *rows = (x.to(device) for x in batch)
    counter = FlopCounterMode(display=False)
    with counter:
        step(pixels, ids, mask, *rows)["loss"].backward()
    return int(counter.get_total_flops())
