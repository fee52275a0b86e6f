"""``nclip bench``: nclip's speed and memory as ratios measured in one run (docs/performance.md).

Rows (every figure is measured in this run; a ratio's two sides are measured side by side):

- xCLIP over CLIP: step time and peak memory, each objective in its own subprocess
  (:mod:`nclip.bench.objective_cost`), alternating clip, xclip, clip, xclip, ...;
- trainer over hand loop: the real training loop's speed as a share of a minimal hand-written
  loop's (:mod:`nclip.bench.loop_overhead`);
- MFU: the FLOPs of one training step (``FlopCounterMode``) per trainer step time, over the
  device's peak (a datasheet figure for known GPUs, else a measured matmul peak: float32 on the CPU);
- synthetic data generation per core at 64 and 224 px, over the 2,000 samples/s target;
- ProtoCLIP's per-episode K-Means and PBT (the paper's 200k × 128 → 20k on a GPU; scaled down on
  the CPU, as the row says);
- evaluation feature extraction, images/s;
- with ``--compare open_clip``: OpenCLIP's ViT-B/16 step next to nclip's CLIP step, where
  ``open_clip`` imports.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from nclip.errors import NclipError


@dataclass
class Sizes:
    """How much each row measures: the CPU defaults (≤ 3 minutes on 2 cores), ``--quick`` (a smoke
    test), or a GPU's."""

    objective_steps: int = 5
    objective_warmup: int = 2
    objective_repeats: int = 2
    loop_repeats: int = 3
    loop_window_s: float = 0.4
    data_64: int = 1000
    data_224: int = 100
    kmeans: tuple[int, int, int] = (20_000, 2_000, 20)  # N, K, iterations
    kmeans_note: str = "1/10 of the paper's N and K (CPU default)"
    eval_images: int = 512

    @classmethod
    def pick(cls, quick: bool, cuda: bool) -> Sizes:
        if quick:
            return cls(objective_steps=2, objective_warmup=1, objective_repeats=1, loop_repeats=2,
                       loop_window_s=0.05, data_64=50, data_224=5, kmeans=(2_000, 50, 3),
                       kmeans_note="a smoke-test scale (--quick)", eval_images=32)
        if cuda:
            return cls(objective_steps=20, objective_warmup=5, objective_repeats=2, loop_repeats=5,
                       loop_window_s=1.0, kmeans=(200_000, 20_000, 20), kmeans_note="the paper's scale",
                       eval_images=4096)
        return cls()


@dataclass
class Report:
    rows: list[tuple[str, float, str]] = field(default_factory=list)  # (what, value, detail)
    details: dict = field(default_factory=dict)

    def add(self, what: str, value: float, detail: str = "") -> None:
        self.rows.append((what, float(value), detail))

    def table(self) -> str:
        width = max(len(r[0]) for r in self.rows)
        lines = [f"{'row':<{width}}  {'value':>10}  detail"]
        lines += [f"{w:<{width}}  {_fmt(v):>10}  {d}" for w, v, d in self.rows]
        return "\n".join(lines)


def _fmt(v: float) -> str:
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
        return f"{v:.3g}"
    return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"


def _objective_costs(preset: str, overrides: list[str], sizes: Sizes, log) -> dict:
    """Each objective's step time and peak memory, one subprocess per measurement."""
    runs: dict[str, list[dict]] = {"clip": [], "xclip": []}
    for _ in range(sizes.objective_repeats):
        for name in runs:
            arg = json.dumps({"preset": preset, "overrides": overrides, "objective": name,
                              "steps": sizes.objective_steps, "warmup": sizes.objective_warmup})
            out = subprocess.run([sys.executable, "-m", "nclip.bench.objective_cost", arg], capture_output=True,
                                 text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
            if out.returncode:
                last = (out.stderr.strip().splitlines() or ["no output"])[-1]
                raise NclipError(f"bench: the {name} step failed: {last}")
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            log(f"bench: {name} step {runs[name][-1]['step_s']:.4f} s")
    med = {n: {"step_s": statistics.median(r["step_s"] for r in rs),
               "peak_mib": statistics.median(r["peak_mib"] for r in rs), "params_m": rs[0]["params_m"]}
           for n, rs in runs.items()}
    return med


def run_bench(preset: str, overrides: list[str], quick: bool = False, compare: list[str] | None = None,
              log=lambda msg: None) -> dict:
    """Every row (module docstring); returns the JSON document (``table`` holds the printed table)."""
    import torch

    from nclip.bench import loop_overhead, parts
    from nclip.config import resolve
    from nclip.precision import autocast_dtype

    cfg = resolve(preset, overrides)
    device = loop_overhead.device_of(cfg)
    if device.type == "cpu" and cfg.train.threads is None:
        # one intra-op thread unless asked: on a shared CPU two OpenMP threads spend most of a small
        # step waiting for each other (measured: a micro step 25 ms on 1 thread, 90-1000 ms on 2)
        overrides = [*overrides, "train.threads=1"]
        cfg = resolve(preset, overrides)
        log("bench: CPU: train.threads=1 (set train.threads to change)")
    torch.set_num_threads(cfg.train.threads or torch.get_num_threads())
    sizes = Sizes.pick(quick, device.type == "cuda")
    rep = Report()

    costs = _objective_costs(preset, overrides, sizes, log)
    clip, xclip = costs["clip"], costs["xclip"]
    rep.add("xclip / clip step time", xclip["step_s"] / clip["step_s"],
            f"clip {clip['step_s']:.4f} s, xclip {xclip['step_s']:.4f} s (paper: 1.3x)")
    rep.add("xclip / clip peak memory", xclip["peak_mib"] / max(clip["peak_mib"], 1e-9),
            f"clip {clip['peak_mib']:.1f} MiB, xclip {xclip['peak_mib']:.1f} MiB (paper: 1.27x)")

    log("bench: trainer vs hand loop")
    loop = loop_overhead.trainer_over_hand(cfg, repeats=sizes.loop_repeats, window_s=sizes.loop_window_s)
    rep.add("trainer / hand loop speed", loop["ratio"],
            f"{loop['clock']} time; step {loop['hand_step_s'] * 1e3:.1f} ms hand, "
            f"{loop['trainer_step_s'] * 1e3:.1f} ms trainer (wall); {loop['steps']} steps x {loop['repeats']}")

    flops = loop_overhead.step_flops(cfg, loop_overhead.one_batch(cfg))
    peak = parts.device_peak(device, autocast_dtype(cfg.train.precision, device))
    achieved = flops / loop["trainer_step_s"]
    mfu = achieved / peak["peak_flops"]
    rep.add("MFU", mfu, f"{flops / 1e9:.2f} GFLOP/step, {achieved / 1e12:.4f} TFLOP/s over "
            f"{peak['peak_flops'] / 1e12:.3f} ({peak['source']})")

    log("bench: data")
    data = {s: parts.data_rate(s, n) for s, n in ((64, sizes.data_64), (224, sizes.data_224))}
    for s, d in data.items():
        rep.add(f"data {s} px samples/s/core", d["samples_per_s_per_core"],
                f"{d['over_target']:.2f}x the {parts.DATA_TARGET:.0f}/s target (CPU time, {d['samples']} samples)")

    from nclip.bench.loader_rate import loader_over_generator  # the loader's rate per worker, same config

    feed = loader_over_generator(cfg, sizes.data_64, workers=1)
    rep.add("generator / loader per worker", feed["ratio"], f"generator {feed['generator_samples_per_s_per_core']:.0f}"
            f"/s/core, loader {feed['samples_per_s_per_worker']:.0f}/s per worker (CPU time; target <= 1.5)")

    log("bench: K-Means and PBT")
    n, k, iters = sizes.kmeans
    km = parts.kmeans_and_pbt(n, k, iters=iters)
    rep.add("K-Means s", km["kmeans_s"], f"{n} x 128 -> {k}, {iters} iterations, {km['method']}; "
            f"{sizes.kmeans_note}")
    rep.add("PBT s", km["pbt_s"],
            f"same scale; Algorithm 1's loop over clusters ~{km['pbt_loop_over_pbt']:.0f}x slower")

    log("bench: eval features")
    ev = parts.eval_rate(cfg, sizes.eval_images, device)
    rep.add("eval features images/s", ev["images_per_s"], f"{ev['images']} images, batch {ev['batch_size']}")

    threads = torch.get_num_threads()
    doc = {
        "device": peak["name"] if device.type == "cuda" else f"cpu ({threads} thread{'s' * (threads != 1)})",
        "preset": preset, "overrides": overrides, "quick": quick,
        "trainer_over_hand_loop": loop["ratio"],
        "xclip_over_clip_time": xclip["step_s"] / clip["step_s"],
        "xclip_over_clip_memory": xclip["peak_mib"] / max(clip["peak_mib"], 1e-9),
        "mfu": mfu,
        "details": {"objectives": costs, "loop": loop, "flops_per_step": flops, "peak": peak, "data": data,
                    "kmeans_pbt": km, "eval": ev, "kmeans_scale": sizes.kmeans_note,
                    "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None},
    }
    for name in compare or []:
        _compare(name, cfg, clip, rep, doc, log)
    doc["rows"] = [{"row": w, "value": v, "detail": d} for w, v, d in rep.rows]
    doc["table"] = rep.table()
    return doc


def _compare(name: str, cfg, clip: dict, rep: Report, doc: dict, log) -> None:
    if name != "open_clip":
        raise NclipError(f"bench: --compare {name!r} is not known; use open_clip")
    import importlib.util

    if importlib.util.find_spec("open_clip") is None:
        log("bench: --compare open_clip skipped: open_clip is not installed")
        doc["open_clip"] = None
        return
    from nclip.bench.open_clip_step import open_clip_step_s

    s = open_clip_step_s(cfg)
    doc["open_clip"] = {"model": "ViT-B-16", "step_s": s}
    rep.add("open_clip ViT-B-16 / nclip clip step", s / clip["step_s"],
            f"open_clip {s:.4f} s at batch {cfg.train.batch_size}, 224 px (compare with --preset vit-b16-xclip)")


def check_finite(doc: dict) -> None:
    """A sanity check for tests and CI: the headline ratios are positive finite numbers."""
    for key in ("trainer_over_hand_loop", "xclip_over_clip_time", "xclip_over_clip_memory", "mfu"):
        v = doc[key]
        if not (isinstance(v, float) and math.isfinite(v) and v > 0):
            raise AssertionError(f"{key} = {v!r}")


def write_json(doc: dict, path: Path) -> None:
    try:
        Path(path).write_text(json.dumps(doc, indent=2) + "\n")
    except OSError as e:
        raise NclipError(f"bench: cannot write {path}: {e.strerror}") from None
