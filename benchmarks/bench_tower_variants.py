"""Step time and peak memory of one training step under variants of a preset: gradient
checkpointing (``model.grad_checkpointing``) and patch dropout (``model.vision.patch_dropout``),
docs/performance.md.

    python benchmarks/bench_tower_variants.py --preset micro --set train.batch_size=256 \\
        --variant off= --variant on=model.grad_checkpointing=true [--repeats 3] [--steps 5]

Each variant is ``NAME=OVERRIDE[,OVERRIDE...]`` (an empty list: the preset as it is). Every
measurement is one step of ``nclip.bench.objective_cost`` (forward, backward, optimizer; xCLIP) in
a fresh process -- the variants interleaved, ``--repeats`` rounds -- and the medians are printed
with their ratio to the first variant. Peak memory is the growth of the peak resident set on the
CPU (``torch.cuda.max_memory_allocated`` on a GPU). ``--vision-only``: instead, the image tower's
forward and backward alone (in training mode), every variant's tower built in this one process and
timed in turn, median of ``--repeats`` rounds of ``--steps`` passes (process CPU time on the CPU).
Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys


def _one(preset: str, overrides: list[str], steps: int, warmup: int) -> dict:
    arg = json.dumps({"preset": preset, "overrides": overrides, "objective": "xclip", "steps": steps,
                      "warmup": warmup})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "nclip.bench.objective_cost", arg], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _vision_only(preset: str, overrides: list[str], variants: dict[str, list[str]], repeats: int,
                 steps: int) -> dict[str, float]:
    import time

    import torch

    from nclip.config import resolve
    from nclip.models.towers import build_vision_tower

    torch.set_num_threads(1)
    towers, batch = {}, None
    for name, extra in variants.items():
        cfg = resolve(preset, [*overrides, *extra])
        torch.manual_seed(0)
        towers[name] = build_vision_tower(cfg.model.vision, cfg.data.image_size).train()
        s = cfg.data.image_size
        batch = torch.randn(cfg.train.batch_size, 3, s, s)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(repeats + 1):  # the first round warms up
        for name, tower in towers.items():
            t0 = time.process_time()
            for _ in range(steps):
                tower(batch).square().mean().backward()
            if r:
                times[name].append((time.process_time() - t0) / steps)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="micro")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--variant", action="append", required=True, help="NAME=OVERRIDE[,OVERRIDE...]")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--vision-only", action="store_true", help="time the image tower's forward + backward alone")
    a = ap.parse_args()
    variants = {}
    for v in a.variant:
        name, _, rest = v.partition("=")
        variants[name] = [o for o in rest.split(",") if o]
    if a.vision_only:
        t = _vision_only(a.preset, a.overrides, variants, a.repeats, a.steps)
        base = next(iter(t.values()))
        print(f"preset {a.preset} {' '.join(a.overrides)}; image tower forward + backward, CPU time, 1 thread")
        for name, v in t.items():
            print(f"{name:>12}: {v * 1e3:8.2f} ms ({v / base:.3f}x)")
        return
    results: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(a.repeats):
        for name, extra in variants.items():
            results[name].append(_one(a.preset, ["train.threads=1", *a.overrides, *extra], a.steps, a.warmup))
    first = next(iter(variants))
    base_t = statistics.median(r["step_s"] for r in results[first])
    base_m = statistics.median(r["peak_mib"] for r in results[first])
    print(f"preset {a.preset} {' '.join(a.overrides)}; device {results[first][0]['device']}; "
          f"{a.repeats} rounds x {a.steps} steps (median)")
    for name, rs in results.items():
        t, m = statistics.median(r["step_s"] for r in rs), statistics.median(r["peak_mib"] for r in rs)
        print(f"{name:>12}: step {t * 1e3:8.1f} ms ({t / base_t:.3f}x)  peak {m:8.1f} MiB ({m / base_m:.3f}x)")


if __name__ == "__main__":
    main()
