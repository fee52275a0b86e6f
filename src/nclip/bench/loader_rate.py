"""The training loader's samples/s per worker next to the data generator's samples/s per core, and
with two views per image next to one view.

Both sides run the same data config (the bench's preset's; synthetic for a preset of CSV or shard
data) at batches of :data:`BATCH`, a GPU's batch per rank (at micro's 16, per-batch costs such as
a tokenizer call and a shared-memory segment per tensor outweigh the samples): the generator is
``build_dataset(cfg, "train")[i]`` alone in this process; the loader is
:func:`nclip.data.loader.train_loader` with ``workers`` worker processes (generation, augmentation,
collation and tokenisation in the workers, batches through shared memory). Rates are per second of
CPU time, the workers' summed (``os.times`` once they are joined), as
:func:`nclip.bench.parts.data_rate` counts the generator's: on a shared machine wall time mostly
measures the other processes. The loader's wall-clock rate and the main process's CPU time per
sample are reported beside it.

Two views (:func:`views_over_one`): the same loader asked for two views per image (CMSF, SupCon...)
as the trainer asks for them, for a device: its workers crop both views as uint8 and draw the strong
view's colour parameters; the colour steps and the normalisation run where the step runs
(:class:`nclip.data.device_feed.DeviceFeed`) and are not a worker's cost. At 224 px, the size of its
target: two views within 1.5× of one view's rate per worker.
"""

from __future__ import annotations

import gc
import math
import os
import time

from nclip.config import RunConfig
from nclip.defaults import BUILTIN_SOURCES

BATCH = 256
VIEWS_SIZE = 224  # the image side of the two-view row


def generator_rate(cfg: RunConfig, n: int) -> float:
    """Training samples generated per second of this process's CPU time."""
    from nclip.data.sources import build_dataset

    samples = build_dataset(cfg, "train")
    for i in range(min(20, len(samples))):  # imports and caches
        samples[i]
    c0 = time.process_time()
    for i in range(n):
        samples[(20 + i) % len(samples)]
    return n / max(time.process_time() - c0, 1e-9)


def _pass(cfg: RunConfig, tokenizer, steps: int, views: int = 1) -> tuple[int, float, float, float]:
    """One pass of the loader over ``steps`` batches: (samples after the first batch, their wall
    seconds, the main process's CPU seconds for them, the workers' CPU seconds in all). Batches as
    the trainer gets them, for a device (two views: uint8 crops, finished there)."""
    from nclip.data.loader import train_loader

    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": steps})})
    before = os.times()
    data = train_loader(cfg, tokenizer, views=views, device="cpu")
    it = iter(data)
    next(it)  # worker start-up and the first batch: outside the wall-clock window
    t0, c0 = time.perf_counter(), time.process_time()
    count = sum(len(b) for b in it)
    wall, main_cpu = time.perf_counter() - t0, time.process_time() - c0
    del it, data
    gc.collect()  # the DataLoader joins its workers: their CPU time lands in os.times' children
    after = os.times()
    workers = after.children_user - before.children_user + after.children_system - before.children_system
    return count, wall, main_cpu, workers


def loader_rate(cfg: RunConfig, n: int, workers: int = 1, views: int = 1) -> dict:
    """Samples/s per worker (CPU time) of the real training loader over about ``n`` samples after
    its first batch, its wall-clock rate, and the main process's CPU seconds per sample; ``views``
    per image. The workers' CPU time is that of a pass of ``n`` samples less that of a pass of one
    batch: a forked worker's start-up (copying the parent's touched pages) is not a per-sample cost."""
    from nclip.data.tokenization import CaptionTokenizer

    batch = cfg.train.batch_size
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"num_workers": workers})})
    tokenizer = CaptionTokenizer(cfg.data.text_length, cfg.model.text.tokenizer)
    count, wall, main_cpu, worker_cpu = _pass(cfg, tokenizer, math.ceil(n / batch) + 1, views)
    per_worker = count / max(main_cpu, 1e-9)
    if workers:
        one = _pass(cfg, tokenizer, 1, views)[3]
        per_worker = count / max(worker_cpu - one, 1e-9)  # per second of one worker's CPU, summed over them
    return {"workers": workers, "samples": count, "batch_size": batch, "samples_per_s_per_worker": per_worker,
            "wall_samples_per_s": count / max(wall, 1e-9), "main_cpu_us_per_sample": 1e6 * main_cpu / max(count, 1)}


def _bench_cfg(cfg: RunConfig, **data) -> RunConfig:
    """``cfg`` at batches of :data:`BATCH`, on a built-in source (synthetic for CSV or shard data)."""
    if cfg.data.source not in BUILTIN_SOURCES:
        data["source"] = "synthetic"
    train = cfg.train.model_copy(update={"batch_size": BATCH})
    return cfg.model_copy(update={"data": cfg.data.model_copy(update=data), "train": train})


def loader_over_generator(cfg: RunConfig, n: int, workers: int = 1) -> dict:
    """The generator's per-core rate over the loader's per-worker rate (1: the loader adds nothing)."""
    cfg = _bench_cfg(cfg)
    gen = generator_rate(cfg, n)
    loader = loader_rate(cfg, n, workers)
    return {"generator_samples_per_s_per_core": gen, **loader,
            "ratio": gen / max(loader["samples_per_s_per_worker"], 1e-9)}


def views_over_one(cfg: RunConfig, n: int, workers: int = 1) -> dict:
    """The loader's per-worker rate with one view per image over its rate with two (1: the second
    view costs the workers nothing), at :data:`VIEWS_SIZE` px on ``cfg``'s data config; each side's
    :func:`loader_rate` under ``one_view`` and ``two_views``."""
    cfg = _bench_cfg(cfg, image_size=VIEWS_SIZE)
    one, two = loader_rate(cfg, n, workers, views=1), loader_rate(cfg, n, workers, views=2)
    rates = one["samples_per_s_per_worker"], two["samples_per_s_per_worker"]
    detail = (f"{VIEWS_SIZE} px: one view {rates[0]:.0f}/s, two views {rates[1]:.0f}/s per worker (CPU time; "
              "the views' colours on the device; target <= 1.5)")
    return {"image_size": VIEWS_SIZE, "one_view": one, "two_views": two, "ratio": rates[0] / max(rates[1], 1e-9),
            "detail": detail}
