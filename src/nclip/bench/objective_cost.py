"""Time and peak memory of one training step (forward, backward, optimizer) under one objective, in
a process of its own so that the peak is not polluted by another objective's: on CUDA
``torch.cuda.max_memory_allocated``; on the CPU the growth of the process's peak resident set over
its value once the model is built (activations, gradients, optimizer state).

One process per objective builds its model once, warms up, then times ``repeats`` windows of
``steps`` steps (``torch.cuda.synchronize`` around each window on CUDA; the step time is the median
of the windows' means); it stops after the window that passes ``deadline`` (``time.time()``), so a
time budget cuts repeats, not the whole row. It also reports the model build's and the first
step's seconds, from which the runner estimates what later rows will cost, and the models it
built (one, counted by :class:`nclip.bench.shared_models.ModelCache`).

Run by :mod:`nclip.bench.runner` as ``python -m nclip.bench.objective_cost '<json>'``; prints one
JSON line. The xCLIP paper reports 1.3x the time and 1.27x the memory of CLIP (ViT-B/16, V100s).
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from pathlib import Path


def config_with_objective(preset: str, overrides: list[str], objective: str):
    """The run's config with ``objective`` in its paper's defaults (the preset's objective section
    replaced, so that e.g. xCLIP's weights do not leak into CLIP's config)."""
    from nclip.config import apply_overrides, load_preset, validate

    raw = apply_overrides(load_preset(preset), overrides)
    raw["objective"] = {"name": objective}
    return validate(raw)


def measure(preset: str, overrides: list[str], objective: str, steps: int, warmup: int, repeats: int = 1,
            deadline: float = float("inf")) -> dict:
    import torch

    from nclip.bench.loop_overhead import device_of
    from nclip.bench.shared_models import shared_models
    from nclip.objectives import build_objective
    from nclip.precision import autocast_dtype, to_float32, tower_autocast
    from nclip.train.optim import build_optimizer

    t_start = time.perf_counter()  # the process's start and imports: the runner's wall time less run_s
    cfg = config_with_objective(preset, overrides, objective)
    device = device_of(cfg)
    if isinstance(cfg.train.threads, int):
        torch.set_num_threads(cfg.train.threads)
    t_build = time.perf_counter()
    with shared_models() as models:  # counts the build, for the bench's JSON
        model = models.get(cfg, pretrained_text=False).to(device).train()
    obj = build_objective(cfg.objective, cfg).to(device)
    opt = build_optimizer([model, obj], cfg.train)
    amp = autocast_dtype(cfg.train.precision, device)
    b, s = cfg.train.batch_size, cfg.data.image_size
    pixels = torch.randn(b, 3, s, s, device=device)
    ids = torch.randint(1000, 5000, (b, cfg.data.text_length), device=device)
    ids[:, -1] = model.tokenizer.eos_id
    mask = torch.ones_like(ids)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step():
        with tower_autocast(device, amp):
            out = model(pixels, ids, mask)
        obj(to_float32(out))["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    sync()
    build_s = time.perf_counter() - t_build
    base_rss = _reset_peak_rss()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    step()  # the first step: allocator, cuDNN/cuBLAS autotune
    sync()
    first_step_s = time.perf_counter() - t0
    for _ in range(warmup - 1):
        step()
    windows = []
    for _ in range(max(repeats, 1)):
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        windows.append((time.perf_counter() - t0) / steps)
        if time.time() > deadline:
            break
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        peak = (_peak_rss_kib() - base_rss) / 1024  # KiB -> MiB
    return {"objective": objective, "step_s": statistics.median(windows), "windows_s": windows,
            "steps": steps, "peak_mib": peak, "build_s": build_s, "first_step_s": first_step_s,
            "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
            "trained_m": sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6, "device": device.type,
            "copy_s": models.copy_s[0], **models.counts(), "run_s": time.perf_counter() - t_start}


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> int:
    """The baseline (KiB) that the step's peak resident set is measured from. On Linux the peak is
    reset first (``clear_refs`` 5) and the baseline is the current resident set, so that a peak
    reached while the model was built cannot hide the step's; elsewhere the process's peak so far."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        current = _status_kib("VmRSS")
        if current is not None:
            return current
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _peak_rss_kib() -> int:
    peak = _status_kib("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


if __name__ == "__main__":
    a = json.loads(sys.argv[1])
    print(json.dumps(measure(a["preset"], a["overrides"], a["objective"], a["steps"], a["warmup"],
                             a.get("repeats", 1), a.get("deadline", float("inf")))))
