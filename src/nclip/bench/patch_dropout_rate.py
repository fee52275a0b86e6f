"""Trainer samples/s at FLIP patch dropout rates 0, 0.5 and 0.75 (ViT image towers only).

One :func:`nclip.train.loop.train` run (one model, no model written) on one in-memory batch of the run's data:
after one warm-up step at each rate (a new token count is a new shape: on CUDA, autotune), timed
windows whose rates alternate 0, 0.5, 0.75, 0, 0.5, ... The trainer sets the image tower's rate
before every step from :func:`nclip.models.patch_dropout.patch_dropout_at` (the config's rate);
for this run the bench gives it the current window's rate instead (:func:`_rates_from`), so that
one built model serves every rate and everything else is the trainer's step. The ratio to p = 0 is
the median of the per-repeat ratios (wall time on a GPU, the process's CPU time on the CPU, as the
trainer row). The target on a GPU: ≥ 1.6x at p = 0.5 on ViT-B/16.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
from pathlib import Path

RATES = (0.0, 0.5, 0.75)


class _AlternatingRates:
    """A data source (as :class:`nclip.bench.loop_overhead._Windows`): one warm-up step per rate,
    then ``repeats`` rounds of one window of ``steps`` steps per rate; ``rate`` is the current one."""

    skipped = 0

    def __init__(self, batch, device, steps: int, repeats: int, deadline: float):
        self.batch, self.device, self.steps, self.repeats, self.deadline = batch, device, steps, repeats, deadline
        self.rate = RATES[0]
        self.windows: dict[float, list] = {p: [] for p in RATES}  # (wall, CPU) s per step

    def state(self) -> dict:
        return {"kind": "map", "skipped": 0}

    def __len__(self) -> int:
        return len(RATES) * (1 + self.steps * self.repeats)

    def __iter__(self):
        import time

        from nclip.bench.loop_overhead import _now, _per_step

        for p in RATES:
            self.rate = p
            yield self.batch
        for _ in range(self.repeats):
            for p in RATES:
                self.rate = p
                t0 = _now(self.device)
                for _ in range(self.steps):
                    yield self.batch
                self.windows[p].append(_per_step(t0, _now(self.device), self.steps))
            if time.perf_counter() > self.deadline:
                return


@contextlib.contextmanager
def _rates_from(source: _AlternatingRates):
    """The trainer's per-step rate is the source's current one, for the ``with`` block."""
    import nclip.train.step as step_module

    real = step_module.patch_dropout_at
    step_module.patch_dropout_at = lambda cfg, step: source.rate
    try:
        yield
    finally:
        step_module.patch_dropout_at = real


def samples_per_s(cfg, steps: int, repeats: int, deadline: float = float("inf")) -> dict:
    """Samples/s of the trainer at each rate of :data:`RATES` and the ratios to p = 0 (module docstring)."""
    from nclip.bench.loop_overhead import device_of, one_batch
    from nclip.train.loop import train

    if cfg.model.vision.kind != "vit":
        raise ValueError(f"patch dropout needs a ViT tower (model.vision.kind is {cfg.model.vision.kind})")
    device = device_of(cfg)
    clock = 0 if device.type == "cuda" else 1
    source = _AlternatingRates(one_batch(cfg), device, steps, repeats, deadline)
    total = len(source) + 1  # never reached: the source stops first
    t = cfg.train.model_copy(update={"steps": total, "schedule_steps": None, "checkpoint_every": total,
                                     "keep_checkpoints": 1, "unmasked_steps": 0})
    with tempfile.TemporaryDirectory(prefix="nclip-bench-") as tmp, _rates_from(source):
        train(cfg.model_copy(update={"train": t}), Path(tmp) / "run", progress=False, evaluate=False,
              data_source=lambda **kw: source, save=False)
    n = min(len(w) for w in source.windows.values())
    batch = cfg.train.batch_size
    rate = {p: statistics.median(batch / w[clock] for w in source.windows[p][:n]) for p in RATES}
    ratios = {p: statistics.median(source.windows[0.0][i][clock] / source.windows[p][i][clock] for i in range(n))
              for p in RATES[1:]}
    return {"samples_per_s": rate, "over_p0": ratios, "clock": ("wall", "cpu")[clock], "steps": steps,
            "repeats": n, "batch_size": batch, "windows_s": {str(p): w for p, w in source.windows.items()}}
