"""The benchmark's rows that are not a training step: synthetic data generation per core, ProtoCLIP's
per-episode K-Means and Prototype Back Translation, evaluation feature extraction, and the device's
peak FLOP/s for MFU.

The K-Means and PBT figures follow ``benchmarks/bench_protoclip.py`` (the paper's scale: 200,000
× 128 features into 20,000 clusters, 20 iterations, App. A.1); on the CPU the default scale is
1/10 of it in N and K (the row says so), ``--quick`` smaller still.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

DATA_TARGET = 2000.0  # synthetic samples/s per core at 64 px (docs/data.md)

# dense bf16 tensor-core peaks, TFLOP/s (vendor datasheets; SXM parts)
GPU_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def data_rate(image_size: int, n: int) -> dict:
    """Synthetic scenes generated per second of this process's CPU time (so per core, whatever else
    runs on the machine: generation is pure numpy on one thread), and the ratio to the target."""
    from nclip.data.synthetic import SyntheticScenes

    ds = SyntheticScenes("train", length=n + 20, image_size=image_size)
    for i in range(20):  # imports and caches
        ds[i]
    c0 = time.process_time()
    for i in range(20, 20 + n):
        ds[i]
    rate = n / max(time.process_time() - c0, 1e-9)
    return {"image_size": image_size, "samples": n, "samples_per_s_per_core": rate,
            "over_target": rate / DATA_TARGET}


def sphere_features(n: int, d: int, k: int, seed: int = 0) -> np.ndarray:
    """Clustered unit vectors: 4·k random directions, each point one of them plus noise."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((4 * k, d)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    x = centres[rng.integers(0, 4 * k, n)] + 0.08 * rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def kmeans_and_pbt(n: int, k: int, d: int = 128, iters: int = 20) -> dict:
    """One K-Means (nclip's ``auto`` method) and one PBT at this scale; PBT also against Algorithm
    1's loop over clusters, timed on a sample of clusters and scaled to K."""
    from nclip.objectives import functional as Fn
    from nclip.train.kmeans import kmeans

    x = sphere_features(n, d, k)
    t0 = time.perf_counter()
    res = kmeans(x, k, niter=iters, method="auto", seed=1)
    kmeans_s = time.perf_counter() - t0
    feats, labels = torch.from_numpy(x), res.labels
    Fn.pbt(feats, labels, k)  # warm-up
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        Fn.pbt(feats, labels, k, return_mask=True)
        times.append(time.perf_counter() - t0)
    pbt_s = statistics.median(times)
    sample = min(k, 100)
    t0 = time.perf_counter()
    for j in range(sample):  # Algorithm 1's PBT, cluster by cluster
        idx = torch.where(labels == j)[0]
        if len(idx):
            feats[idx].mean(0)
    loop_s = (time.perf_counter() - t0) * k / sample
    return {"n": n, "k": k, "d": d, "iters": iters, "method": res.method, "kmeans_s": kmeans_s,
            "pbt_s": pbt_s, "pbt_loop_est_s": loop_s, "pbt_loop_over_pbt": loop_s / max(pbt_s, 1e-9)}


def eval_rate(cfg, n: int, device: torch.device, workers: int | None = None) -> dict:
    """Images/s of the evaluation's feature extraction (pre-processing + image tower + heads, under
    the run's autocast, as its evaluations encode) over ``n`` held-out synthetic scenes (made before
    the clock starts, by :func:`scenes`), timed after a warm-up batch. The model:
    :func:`nclip.bench.shared_models.build` (a copy of the bench's)."""
    from nclip.bench.shared_models import build
    from nclip.eval.features import extract
    from nclip.precision import autocast_dtype

    model = build(cfg).to(device)
    items = scenes(n, cfg.data.image_size, workers)
    bs = min(cfg.eval.batch_size, n)
    dtype = autocast_dtype(cfg.train.precision, device)  # as the run's own evaluations encode
    extract(model, items[:bs], cfg.data.image_size, device, bs, texts=False, autocast=dtype)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    extract(model, items, cfg.data.image_size, device, bs, texts=False, autocast=dtype)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"images": n, "batch_size": bs, "images_per_s": n / max(time.perf_counter() - t0, 1e-9)}


SCENES_PER_TASK = 64  # fewer scenes than this per worker: made in this process (a pool costs more)


def scenes(n: int, image_size: int, workers: int | None = None) -> list:
    """The first ``n`` held-out synthetic scenes (``SyntheticScenes("val")``, masks dropped: the
    evaluation reads images and labels), made by ``workers`` processes (default: one per core this
    process may use, at least :data:`SCENES_PER_TASK` scenes each; 4,096 scenes at 224 px take
    seconds on one core). The workers write the images into one shared-memory array (616 MB at
    that size, no pickling through pipes) and send back the rest. Each scene depends on its index
    alone, and every chunk lands in its place, so the list is the same whatever the workers."""
    import os

    if workers is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        workers = max(1, min(cores, n // SCENES_PER_TASK))
    if workers <= 1:
        return _make_scenes(None, n, image_size, 0, n)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from dataclasses import replace

    images = torch.empty((n, image_size, image_size, 3), dtype=torch.uint8).share_memory_()
    # fork where there is one: the workers run NumPy only (no CUDA, no torch threads) and start in
    # milliseconds rather than re-importing nclip
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
    step = -(-n // (4 * workers))  # 4 chunks per worker: a slow chunk delays the end less
    starts = list(range(0, n, step))
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        parts = list(pool.map(_make_scenes, [images] * len(starts), [n] * len(starts), [image_size] * len(starts),
                              starts, [min(a + step, n) for a in starts]))
    pixels = images.numpy()
    return [replace(s, image=pixels[i]) for i, s in enumerate(s for part in parts for s in part)]


def _make_scenes(images: torch.Tensor | None, n: int, image_size: int, start: int, stop: int) -> list:
    """Scenes ``start`` to ``stop`` of :func:`scenes`, without their masks; with ``images`` (shared
    memory) each image is written there and left out of the scene returned."""
    from dataclasses import replace

    from nclip.data.synthetic import SyntheticScenes

    samples = SyntheticScenes("val", length=n, image_size=image_size)
    out = []
    for i in range(start, stop):
        s = samples[i]
        if images is not None:
            images[i].numpy()[...] = s.image
            s = replace(s, image=None)
        out.append(replace(s, masks=None))
    return out


def device_peak(device: torch.device, dtype: torch.dtype | None) -> dict:
    """The peak FLOP/s that MFU divides by: a GPU's datasheet dense bf16 figure when its name is in
    :data:`GPU_PEAK_TFLOPS`; otherwise measured, the best of a few large matmuls in the step's
    dtype (float32 on the CPU)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in GPU_PEAK_TFLOPS.items():
            if key in name:
                return {"name": name, "peak_flops": tflops * 1e12, "source": "datasheet dense bf16"}
    else:
        name = "cpu"
    n = 4096 if device.type == "cuda" else 1024
    dt = dtype if device.type == "cuda" and dtype is not None else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dt), torch.randn(n, n, device=device, dtype=dt)
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return {"name": name, "peak_flops": 2 * n**3 / best,
            "source": f"measured {str(dt).removeprefix('torch.')} matmul {n}x{n} (best of 5)"}
