"""The largest global batch per device: a linear fit of the peak memory of measured training steps.

For these models a training step's peak memory is linear in the batch: weights, gradients and
AdamW state do not depend on it (the fixed part ``a``), and every activation is per row (``b``
bytes per sample; attention over a fixed number of tokens per image is per row too). So the
bench measures the peak of real trainer steps (:func:`nclip.train.loop.train`, two steps, the
setting on) at two or three batch sizes, fits peak = a + b·B by least squares, says how far the
measured points lie from the line (the residual), and reports the largest B under the limit:
``floor((limit − a) / b)`` — a linear fit of measured steps, not a run at that batch.

What is measured, from the first batch the trainer asks for (the model and optimizer built) to the
end of the second step, over the memory the process held before the run:

- CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, less what was
  allocated before the run (allocated bytes: the caching allocator's fragmentation comes on top);
  the limit is the device's free memory (``mem_get_info`` after ``empty_cache``) or ``--memory-gib``;
- CPU: the growth of the peak resident set (``VmHWM`` after a reset through ``clear_refs``) over
  the resident set before the run, in one subprocess for all points with ``malloc_trim`` between
  them (a subprocess per point costs ~10 s of imports on a loaded 2-core machine); a first,
  discarded run takes the one-off allocations (kernels, thread pools). The limit defaults to 8 GiB.

Each run writes no model (``train(save=False)``) and gets a copy of one model built once per model
config (:mod:`nclip.bench.shared_models`: two builds, plain and checkpointed, for every point).

Settings: none, ``model.grad_checkpointing=true``, and exact accumulation
(``train.accumulation_mode=exact``, :mod:`nclip.train.accumulate`). Exact accumulation's peak is
the towers' at the micro-batch m plus the heads' and objective's at the whole batch B plus the
cached features (per row): peak ≈ c + t·m + h·B. Its points run at one micro-batch m0 with k > 1
(B = k·m0), which gives h (bytes per sample of the whole batch) and c + t·m0; the towers' t is the
plain fit's b less h. The row reports the largest B (a multiple of m) at m = a quarter of the
largest plain batch.
"""

from __future__ import annotations

import gc
import json
import sys
import tempfile
from pathlib import Path

from nclip.train.memory_check import fit_line, largest_batch  # noqa: F401 (the bench's API)

GIB = 2**30
CPU_LIMIT_GIB = 8.0
SETTINGS = {
    "none": [],
    "grad checkpointing": ["model.grad_checkpointing=true"],
    "exact accumulation": ["train.accumulation_mode=exact"],
}


def exact_largest(none: dict, exact: dict, m0: int, micro: int, limit: float) -> dict:
    """Exact accumulation's largest batch at micro-batch ``micro`` (module docstring): ``none`` and
    ``exact`` the fits of the plain points and of the k > 1 points at micro-batch ``m0``."""
    h = exact["b"]  # bytes per row of the whole batch: heads, objective, cached features
    t = max(none["b"] - h, 0.0)  # the towers' bytes per row of the micro-batch
    fixed = exact["a"] + t * (micro - m0)
    return {"batch": largest_batch(fixed, h, limit, multiple=micro), "micro": micro, "fixed": fixed,
            "per_sample": h, "tower_per_sample": t}


def plan(sizes: tuple[int, ...], m0: int, ks: tuple[int, ...]) -> list[tuple[str, int, int]]:
    """The points measured: (setting, batch, accumulation) for the plain and checkpointed steps at
    ``sizes`` and exact accumulation at micro-batch ``m0`` with each k in ``ks``."""
    points = [(s, n, 1) for s in ("none", "grad checkpointing") for n in sizes]
    return points + [("exact accumulation", m0 * k, k) for k in ks]


def point_config(preset: str, overrides: list[str], setting: str, batch: int, k: int):
    from nclip.config import resolve

    extra = [f"train.batch_size={batch}", f"train.accumulation={k}", *SETTINGS[setting]]
    return resolve(preset, [*overrides, *extra])


class _PeakSource:
    """A data source for :func:`nclip.train.loop.train` (as :class:`nclip.bench.loop_overhead._Windows`)
    that yields one in-memory batch ``steps`` times; the peak is reset at the first request (model
    and optimizer built) and read at the request after the last step."""

    skipped = 0

    def __init__(self, batch, device, steps: int):
        self.batch, self.device, self.steps = batch, device, steps
        self.peak: int | None = None

    def state(self) -> dict:
        return {"kind": "map", "skipped": 0}

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _reset_peak_rss()
        for _ in range(self.steps):
            yield self.batch
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self.peak = _status_kib("VmHWM") * 1024


def step_peak(cfg, steps: int = 2) -> int:
    """Peak bytes of ``steps`` real trainer steps on ``cfg`` over the memory held before the run."""
    import torch

    from nclip.bench.loop_overhead import device_of, one_batch
    from nclip.train.loop import train

    device = device_of(cfg)
    batch = one_batch(cfg)
    base = _settle(device)
    t = cfg.train.model_copy(update={"steps": steps + 1, "schedule_steps": None, "checkpoint_every": steps + 1,
                                     "keep_checkpoints": 1, "log_every": steps + 1, "eval_every": 0})
    source = _PeakSource(batch, device, steps)
    with tempfile.TemporaryDirectory(prefix="nclip-bench-") as tmp:
        train(cfg.model_copy(update={"train": t}), Path(tmp) / "run", progress=False, evaluate=False,
              data_source=lambda **kw: source, save=False)
    del batch
    _settle(device)
    if source.peak is None:
        raise RuntimeError("the trainer stopped before its steps")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return source.peak - base


def _settle(device) -> int:
    """Free what can be freed; the memory now held (CUDA: allocated bytes; CPU: resident set)."""
    gc.collect()
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()
        return torch.cuda.memory_allocated(device)
    try:  # glibc keeps freed heap pages resident: give them back so the next point's growth is its own
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return _status_kib("VmRSS") * 1024


def _status_kib(field: str) -> int:
    from nclip.bench.objective_cost import _status_kib as status

    v = status(field)
    if v is None:
        raise RuntimeError(f"/proc/self/status has no {field}: the CPU memory rows need Linux")
    return v


def _reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def measure(preset: str, overrides: list[str], points: list[tuple[str, int, int]], warm: bool = True) -> list[dict]:
    """Each point's peak bytes, in this process (a discarded first run at the first point where ``warm``).
    Every point's run gets a copy of one model per model config (plain, checkpointed), built once
    (:func:`nclip.bench.shared_models.shared_models`)."""
    from nclip.bench.shared_models import shared_models

    configs = [point_config(preset, overrides, *p) for p in points]
    with shared_models() as models:
        for cfg in configs:  # every model built before the first point: no point's growth holds a build
            models.prepare(cfg)
        if warm and points:
            step_peak(configs[0])
        return [{"setting": s, "batch": n, "k": k, "peak": step_peak(cfg)} for (s, n, k), cfg in zip(points, configs)]


def limit_bytes(device, memory_gib: float | None) -> tuple[float, str]:
    """The memory limit and where it comes from."""
    if memory_gib:
        return memory_gib * GIB, f"{memory_gib:g} GiB (--memory-gib)"
    if device.type == "cuda":
        import torch

        gc.collect()
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
        free = float(free + torch.cuda.memory_reserved(device))
        return free, f"{free / GIB:.1f} GiB (the device's free memory)"
    return CPU_LIMIT_GIB * GIB, f"{CPU_LIMIT_GIB:g} GiB (the CPU default; --memory-gib)"


def largest_batches(measured: list[dict], m0: int, limit: float) -> dict:
    """Fits and largest batches per setting from :func:`measure`'s points (module docstring)."""
    out = {}
    for setting in ("none", "grad checkpointing", "exact accumulation"):
        pts = [p for p in measured if p["setting"] == setting]
        fit = fit_line([p["batch"] for p in pts], [p["peak"] for p in pts])
        out[setting] = {**fit, "points": [[p["batch"], p["k"], p["peak"]] for p in pts]}
    none = out["none"]
    none["batch"] = largest_batch(none["a"], none["b"], limit)
    out["grad checkpointing"]["batch"] = largest_batch(out["grad checkpointing"]["a"], out["grad checkpointing"]["b"],
                                                       limit)
    micro = max(m0, (none["batch"] or 0) // 4)
    out["exact accumulation"].update(exact_largest(none, out["exact accumulation"], m0, micro, limit))
    return out


def run(preset: str, overrides: list[str], device, points: list[tuple[str, int, int]],
        timeout: float | None) -> tuple[list, dict]:
    """:func:`measure` in a subprocess on the CPU (one process start for every point), in this process
    on CUDA; with the subprocess's model builds and copies (none: this process's are counted here)."""
    if device.type == "cuda":
        return measure(preset, overrides, points, warm=False), {"builds": 0, "copies": 0}
    import os
    import subprocess

    arg = json.dumps({"preset": preset, "overrides": overrides, "points": points})
    out = subprocess.run([sys.executable, "-m", "nclip.bench.batch_memory", arg], capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=timeout)
    if out.returncode:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the memory steps failed: {last}")
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    return doc["points"], doc["models"]


if __name__ == "__main__":
    from nclip.bench.shared_models import shared_models

    a = json.loads(sys.argv[1])
    with shared_models() as models:
        measured = measure(a["preset"], a["overrides"], [tuple(p) for p in a["points"]])
    print(json.dumps({"points": measured, "models": models.counts()}))
