"""Time and peak memory of one training step (forward, backward, optimizer) under one objective, in
a process of its own so that the peak is not polluted by another objective's: on CUDA
``torch.cuda.max_memory_allocated``; on the CPU the growth of the process's peak resident set over
its value once the model is built (activations, gradients, optimizer state).

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


def measure(preset: str, overrides: list[str], objective: str, steps: int, warmup: int) -> dict:
    import torch

    from nclip.bench.loop_overhead import device_of
    from nclip.config import apply_overrides, load_preset, validate
    from nclip.models import build_model
    from nclip.objectives import build_objective
    from nclip.precision import autocast_dtype, to_float32, tower_autocast
    from nclip.train.optim import build_optimizer

    raw = apply_overrides(load_preset(preset), overrides)
    raw["objective"] = {"name": objective}  # the paper's defaults for every objective
    cfg = validate(raw)
    device = device_of(cfg)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(0)
    model = build_model(cfg, pretrained_text=False).to(device).train()
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

    base_rss = _reset_peak_rss()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for i in range(warmup + steps):
        sync()
        t0 = time.perf_counter()
        with tower_autocast(device, amp):
            out = model(pixels, ids, mask)
        obj(to_float32(out))["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        peak = (_peak_rss_kib() - base_rss) / 1024  # KiB -> MiB
    return {"objective": objective, "step_s": statistics.median(times), "peak_mib": peak,
            "params_m": sum(p.numel() for p in model.parameters()) / 1e6, "device": device.type}


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
    print(json.dumps(measure(a["preset"], a["overrides"], a["objective"], a["steps"], a["warmup"])))
