"""Trainer over hand loop: the real training loop (:func:`nclip.train.loop.train`, what ``nclip
train`` runs) against a minimal hand-written loop, on the same model config, batch and optimizer.

Both loops get one real batch of the run's data, built once and kept in device memory as the loader
makes it (uint8 pixels), so the data loader and the host-to-device copy are out of the comparison
(:mod:`nclip.bench.train_path` puts them back in). Both take every step's batch from a
:class:`nclip.data.device_feed.DeviceFeed`, which normalises the pixels on the device (and whatever
else the feed does to a batch), so both pay for it; what remains is what the trainer adds around
forward, backward and the optimizer step (the lr schedule, the non-finite guard, the gradient norm,
the logged terms, metrics.jsonl, the counters). The hand loop is what a user would write:

    batch = next(feed)                        # the batch on the device, pixels normalised
    out = model(batch.pixels, batch.ids, batch.mask)  # under the run's autocast
    loss = objective(to_float32(out))["loss"]
    loss.backward(); optimizer.step(); optimizer.zero_grad(set_to_none=True)

Each loop has its model once (a ViT-B/16 xCLIP model has 414 M parameters: building it for every
repeat took most of the bench's time on an H100); inside :func:`nclip.bench.shared_models.shared_models`
the two are copies of one build. The hand loop (:class:`HandLoop`) is made first and warmed up;
then one :func:`nclip.train.loop.train` run (``save=False``: it writes no model) is fed the batch by
a data source (:class:`_Windows`) that, after the trainer's warm-up steps, times windows of
``steps`` steps (from the request of a window's first batch to the request after its last, so the
model build and the warm-up are outside them) and, between two windows, runs a window of the hand
loop. So the repeats alternate trainer, hand, trainer, hand, ... in one process, and the ratio is
the median of the per-repeat ratios, which a loaded machine disturbs less than either time alone.
The data source stops after the last window, before ``train.steps``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from nclip.batch import Batch
from nclip.bench.shared_models import build
from nclip.config import RunConfig
from nclip.data.device_feed import DeviceFeed
from nclip.data.labels import label_space_for
from nclip.data.loader import train_loader
from nclip.data.tokenization import CaptionTokenizer
from nclip.objectives import build_objective, plan_for
from nclip.precision import autocast_dtype
from nclip.train.optim import build_optimizer
from nclip.train.step import TrainStep

Clock = tuple[float, float]  # (wall, process CPU) seconds


def one_batch(cfg: RunConfig) -> Batch:
    """The run's first training batch, as the trainer's loader makes it
    (with the model's tokenizer, made without building the model)."""
    objective = plan_for(cfg)
    tokenizer = CaptionTokenizer(cfg.data.text_length, cfg.model.text.tokenizer)
    data = train_loader(cfg, tokenizer, views=objective.views, labels=objective.label_request())
    return next(iter(data))


def device_of(cfg: RunConfig) -> torch.device:
    want = cfg.train.device
    return torch.device("cuda" if want != "cpu" and torch.cuda.is_available() else "cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_parts(cfg: RunConfig, device: torch.device):
    """Model, objective and optimizer as the trainer builds them (same threads, seed and order)."""
    if isinstance(cfg.train.threads, int):  # auto: the machine's own count, as the bench measures
        torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(cfg.seed)
    model = build(cfg)
    objective = build_objective(cfg.objective, cfg, label_space=label_space_for(cfg))
    model.to(device)
    objective.to(device)
    return model, objective, build_optimizer([model, objective], cfg.train)


class HandLoop:
    """The minimal loop (module docstring), built once: :meth:`window` times ``steps`` steps.

    ``count_flops``: the FLOPs of one forward and backward are counted first (eager, before any
    compilation; ``flops``), so that the MFU row needs no model of its own. With ``train.compile``
    the step (towers, heads, float32 objective: a ``TrainStep``) is compiled as the trainer compiles
    it, so that both loops run the same code."""

    def __init__(self, cfg: RunConfig, batch: Batch, warmup: int = 1, count_flops: bool = False):
        self.device = device = device_of(cfg)
        self.model, self.objective, self.optimizer = build_parts(cfg, device)
        self.amp = autocast_dtype(cfg.train.precision, device)
        self.batch = batch.to(device)  # as the loader makes it: uint8 pixels
        self.feed = iter(DeviceFeed(_Repeat(self.batch), device))  # normalised on the device, as the trainer's
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.clip = cfg.train.grad_clip
        self.flops = self._count_flops() if count_flops else None
        self.train_step = TrainStep(self.model, self.objective, self.amp)  # the trainer's forward, no more
        if cfg.train.compile:
            from nclip.train.compile import compile_step

            compile_step(self.train_step)
        self.model.train()
        self.objective.train()
        self.warmup = max(warmup, 1)
        self.pilot = self.window(self.warmup)  # the first steps (allocator, autotune, compile) are untimed
        self.start_s = self.pilot[0] * self.warmup  # their wall seconds

    def _count_flops(self) -> int:
        from torch.utils.flop_counter import FlopCounterMode

        batch = next(self.feed)
        step = TrainStep(self.model, self.objective, self.amp)
        counter = FlopCounterMode(display=False)
        with counter:
            step(batch)["loss"].backward()
        self.optimizer.zero_grad(set_to_none=True)
        return int(counter.get_total_flops())

    def step(self) -> None:
        loss = self.train_step(next(self.feed))["loss"]
        loss.backward()
        if self.clip:  # part of the recipe, not of the trainer: the hand loop clips as well
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def window(self, steps: int) -> Clock:
        """(wall, process CPU) seconds per step over ``steps`` steps."""
        return timed_steps(self.step, self.device, steps)


def timed_steps(step, device: torch.device, steps: int) -> Clock:
    """(wall, process CPU) seconds per call of ``step`` over ``steps`` calls (synchronised on CUDA)."""
    t0 = _now(device)
    for _ in range(steps):
        step()
    return _per_step(t0, _now(device), steps)


def _now(device: torch.device) -> Clock:
    """(wall, process CPU) seconds, after the device's queued work."""
    _sync(device)
    return time.perf_counter(), time.process_time()


def _per_step(t0: Clock, t1: Clock, steps: int) -> Clock:
    return (t1[0] - t0[0]) / steps, (t1[1] - t0[1]) / steps


class _Repeat:
    """One batch, endlessly: a data source for :class:`DeviceFeed` (its interface: ``skipped``,
    ``state()``, iteration)."""

    skipped = 0

    def __init__(self, batch: Batch):
        self.batch = batch

    def state(self) -> dict:
        return {"kind": "map", "skipped": 0}

    def __iter__(self):
        while True:
            yield self.batch


class _Windows:
    """A data source for :func:`nclip.train.loop.train` (its interface: ``skipped``, ``state()``,
    iteration) that yields one in-memory batch every step: ``warmup`` steps, then up to ``repeats``
    timed windows of ``steps`` steps, ``between()`` after each; it stops early once ``deadline``
    (``time.perf_counter()``) has passed, after at least one window."""

    skipped = 0

    def __init__(self, batch: Batch, device: torch.device, warmup: int, steps: int, repeats: int,
                 between: Callable[[], None] | None = None, deadline: float = float("inf")):
        self.batch, self.device, self.warmup, self.steps, self.repeats = batch, device, warmup, steps, repeats
        self.between, self.deadline = between, deadline
        self.windows: list[Clock] = []  # (wall, CPU) seconds per step of each window

    def state(self) -> dict:
        return {"kind": "map", "skipped": 0}

    def __len__(self) -> int:
        return self.warmup + self.steps * self.repeats

    def __iter__(self):
        for _ in range(self.warmup):
            yield self.batch
        for _ in range(self.repeats):
            t0 = _now(self.device)
            for _ in range(self.steps):
                yield self.batch
            self.windows.append(_per_step(t0, _now(self.device), self.steps))  # at the next request
            if self.between is not None:
                self.between()
            if time.perf_counter() > self.deadline:
                return


def trainer_windows(cfg: RunConfig, batch: Batch, warmup: int, steps: int, repeats: int,
                    between: Callable[[], None] | None = None, deadline: float = float("inf")) -> list[Clock]:
    """One :func:`nclip.train.loop.train` run (one model) over ``batch``, held on the device: (wall, CPU)
    seconds per step of each timed window, ``between()`` run after each (module docstring)."""
    from nclip.train.loop import train

    total = warmup + steps * repeats + 1  # never reached: the source stops first
    t = cfg.train.model_copy(update={"steps": total, "schedule_steps": None, "checkpoint_every": total,
                                     "keep_checkpoints": 1})
    run_cfg = cfg.model_copy(update={"train": t})
    device = device_of(cfg)
    source = _Windows(batch.to(device), device, warmup, steps, repeats, between, deadline)
    with tempfile.TemporaryDirectory(prefix="nclip-bench-") as tmp:
        train(run_cfg, Path(tmp) / "run", progress=False, evaluate=False, data_source=lambda **kw: source,
              save=False)
    return source.windows


def steps_for(seconds_per_step: float, window_s: float, lo: int = 5, hi: int = 400) -> int:
    """Steps that fill about ``window_s`` seconds."""
    return max(lo, min(hi, int(window_s / max(seconds_per_step, 1e-6)) + 1))


def trainer_over_hand(cfg: RunConfig, repeats: int = 3, window_s: float = 0.4, warmup: int = 3,
                      deadline: float = float("inf"), keep_hand: bool = False, count_flops: bool = False) -> dict:
    """The trainer's speed as a share of the hand loop's (hand step time / trainer step time: 1 is
    no overhead), the median over interleaved repeats, with both loops' median step times. Each
    loop's model is built once (module docstring); repeats stop early past ``deadline``.

    The clock: wall time on a GPU; on the CPU the process's CPU time (``clock: cpu``), since on a
    shared machine the wall time mostly measures the other processes (both are reported).
    ``keep_hand``: the result's ``"hand"`` is the :class:`HandLoop`, for another row to reuse;
    ``count_flops``: ``"flops"`` is one step's forward and backward FLOPs (:meth:`HandLoop._count_flops`)."""
    batch = one_batch(cfg)
    device = device_of(cfg)
    clock = 0 if device.type == "cuda" else 1
    hand_loop_ = HandLoop(cfg, batch, warmup, count_flops=count_flops)
    steps = steps_for(hand_loop_.pilot[0], window_s)
    hand: list[Clock] = []
    trainer = trainer_windows(cfg, batch, warmup, steps, repeats,
                              between=lambda: hand.append(hand_loop_.window(steps)), deadline=deadline)
    ratios = [h[clock] / t[clock] for h, t in zip(hand, trainer)]
    wall = [h[0] / t[0] for h, t in zip(hand, trainer)]
    out = {"ratio": statistics.median(ratios), "clock": ("wall", "cpu")[clock],
           "ratio_wall": statistics.median(wall), "ratios": ratios,
           "hand_step_s": statistics.median(h[0] for h in hand),
           "trainer_step_s": statistics.median(t[0] for t in trainer),
           "steps": steps, "repeats": len(trainer), "flops": hand_loop_.flops}
    if keep_hand:
        out["hand"] = hand_loop_
    return out
