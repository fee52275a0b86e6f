"""The real ``nclip train`` path over the hand loop: what a user's run gets per second, data loader
included, as a share of the minimal loop on a batch already in device memory.

The train path is :func:`nclip.train.loop.train` itself with no data source of its own: the run's
:func:`nclip.data.loader.train_loader` (built-in synthetic data at the preset's image size, or the
configured source; ``data.num_workers`` as configured), the trainer's step and logging, into a
temporary directory (``evaluate=False``, no progress bar: ``nclip train --no-progress --no-eval``;
``save=False``: no checkpoint or model is written, which a real run does every
``train.checkpoint_every`` steps, outside the steps timed here). Its samples/s is read from the run's metrics.jsonl
(``train.log_every`` set to the window's steps), the trainer's own figure, so nothing is added to
the measured path; the first logged window is left out (it holds the first steps and the loader's
start). Then the hand loop (:class:`nclip.bench.loop_overhead.HandLoop`, the trainer row's when the
runner passes it, so no model is built for it again) runs as many windows on its in-memory batch.
Ratio: the train path's median samples/s over the hand loop's (target on an H100: ≥ 0.97, at most 3 % lost).
Both sides are wall time (the loader's workers are other processes), so on a shared CPU the figure
is noisier than the CPU-time ratio of the trainer row.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from nclip.bench.loop_overhead import HandLoop, one_batch
from nclip.config import RunConfig


def train_path_over_hand(cfg: RunConfig, steps: int, repeats: int, warmup: int = 3,
                         hand: HandLoop | None = None) -> dict:
    """Samples/s of the real training path and of the hand loop, and their ratio (module docstring):
    ``repeats`` windows of ``steps`` steps each, after one warm-up window of the trainer."""
    from nclip.train.loop import train

    total = steps * (repeats + 1)
    t = cfg.train.model_copy(update={"steps": total, "schedule_steps": None, "log_every": steps,
                                     "checkpoint_every": total, "keep_checkpoints": 1,
                                     "eval_every": 0})  # no evaluation rows between the windows
    run_cfg = cfg.model_copy(update={"train": t})
    with tempfile.TemporaryDirectory(prefix="nclip-bench-") as tmp:
        run_dir = Path(tmp) / "run"
        train(run_cfg, run_dir, progress=False, evaluate=False, save=False)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    logged = [r["samples_per_s"] for r in rows if "samples_per_s" in r]
    train_rates = logged[1:] or logged  # the first window holds the warm-up
    if hand is None:
        hand = HandLoop(cfg, one_batch(cfg), warmup)
    b = cfg.train.batch_size
    hand_rates = [b / hand.window(steps)[0] for _ in range(len(train_rates))]
    train_sps, hand_sps = statistics.median(train_rates), statistics.median(hand_rates)
    return {"ratio": train_sps / hand_sps, "train_samples_per_s": train_sps, "hand_samples_per_s": hand_sps,
            "train_windows": train_rates, "hand_windows": hand_rates, "steps": steps,
            "num_workers": cfg.data.num_workers, "batch_size": b, "clock": "wall"}
