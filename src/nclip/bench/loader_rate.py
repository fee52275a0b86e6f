"""The training loader's samples/s per worker next to the data generator's samples/s per core.

Both sides run the same config (the bench's preset; its built-in source, synthetic for a preset
of CSV or shard data, and batches of at most 256): the generator is ``build_dataset(cfg,
"train")[i]`` alone in this process; the loader is :func:`nclip.data.loader.train_loader` with
``workers`` worker processes (generation, augmentation, collation and tokenisation in the workers,
batches through shared memory). Rates are per second of CPU time, the workers' summed (read from
``os.times`` once they are joined), as :func:`nclip.bench.parts.data_rate` counts the generator's:
on a shared machine wall time mostly measures the other processes. The loader's wall-clock rate and
the main process's CPU time per sample are reported beside it.
"""

from __future__ import annotations

import gc
import math
import os
import time

from nclip.config import RunConfig
from nclip.defaults import BUILTIN_SOURCES


def generator_rate(cfg: RunConfig, n: int) -> float:
    """Training samples generated per second of this process's CPU time."""
    from nclip.data.loader import build_dataset

    samples = build_dataset(cfg, "train")
    for i in range(min(20, len(samples))):  # imports and caches
        samples[i]
    c0 = time.process_time()
    for i in range(n):
        samples[(20 + i) % len(samples)]
    return n / max(time.process_time() - c0, 1e-9)


def loader_rate(cfg: RunConfig, n: int, workers: int = 1) -> dict:
    """Samples/s per worker (CPU time) of the real training loader over about ``n`` samples after
    its first batch, its wall-clock rate, and the main process's CPU seconds per sample."""
    from nclip.data.loader import train_loader
    from nclip.data.tokenization import CaptionTokenizer

    batch = cfg.train.batch_size
    steps = math.ceil(n / batch) + 1
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": steps}),
                                 "data": cfg.data.model_copy(update={"num_workers": workers})})
    tokenizer = CaptionTokenizer(cfg.data.text_length, cfg.model.text.tokenizer)
    children0 = os.times()
    data = train_loader(cfg, tokenizer)
    it = iter(data)
    next(it)  # worker start-up and the first batch: outside the wall-clock window
    t0, c0 = time.perf_counter(), time.process_time()
    count = sum(b[0].shape[0] for b in it)
    wall, main_cpu = time.perf_counter() - t0, time.process_time() - c0
    del it, data
    gc.collect()  # the DataLoader joins its workers: their CPU time lands in os.times' children
    children1 = os.times()
    worker_cpu = (children1.children_user - children0.children_user
                  + children1.children_system - children0.children_system)
    total = count + batch
    return {"workers": workers, "samples": count, "batch_size": batch,
            "samples_per_s_per_worker": total / max(worker_cpu, 1e-9) if workers else count / max(main_cpu, 1e-9),
            "wall_samples_per_s": count / max(wall, 1e-9),
            "main_cpu_us_per_sample": 1e6 * main_cpu / max(count, 1)}


def loader_over_generator(cfg: RunConfig, n: int, workers: int = 1) -> dict:
    """The generator's per-core rate over the loader's per-worker rate (1: the loader adds nothing)."""
    data = cfg.data if cfg.data.source in BUILTIN_SOURCES else cfg.data.model_copy(update={"source": "synthetic"})
    train = cfg.train.model_copy(update={"batch_size": min(cfg.train.batch_size, 256)})
    cfg = cfg.model_copy(update={"data": data, "train": train})
    gen = generator_rate(cfg, n)
    loader = loader_rate(cfg, n, workers)
    return {"generator_samples_per_s_per_core": gen, **loader,
            "ratio": gen / max(loader["samples_per_s_per_worker"], 1e-9)}
