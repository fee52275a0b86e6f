"""Cost of each objective relative to CLIP, measured in the same run: time per training step and
peak memory of a full step (forward, backward, AdamW), at a preset's model size.

The xCLIP paper reports 1.3x time and 1.27x memory for xCLIP over CLIP (ViT-B/16, V100s). Run:

    python benchmarks/bench_objectives.py                       # tiny preset on the CPU
    python benchmarks/bench_objectives.py --preset vit-b16-xclip --set train.batch_size=64  # on a GPU

Each objective runs in its own subprocess so that peak memory is not polluted by the previous
one: on CUDA the peak is torch.cuda.max_memory_allocated; on the CPU it is the growth of the
process's peak resident set over the model-built baseline (activations, gradients, optimizer).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time


def measure(preset: str, objective: str, overrides: list[str], steps: int, warmup: int) -> dict:
    import torch

    from nclip.config import apply_overrides, load_preset, validate
    from nclip.models import build_model
    from nclip.objectives import build_objective
    from nclip.train.optim import build_optimizer

    raw = apply_overrides(load_preset(preset), overrides)
    raw["objective"] = {"name": objective}  # the paper's defaults for every objective
    cfg = validate(raw)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = build_model(cfg).to(device).train()
    obj = build_objective(cfg.objective).to(device)
    opt = build_optimizer([model, obj], cfg.train)
    b, s = cfg.train.batch_size, cfg.data.image_size
    pixels = torch.randn(b, 3, s, s, device=device)
    ids = torch.randint(1000, 5000, (b, cfg.data.text_length), device=device)
    ids[:, -1] = model.tokenizer.eos_id
    mask = torch.ones_like(ids)
    amp = device.type == "cuda"

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            out = model(pixels, ids, mask)
        loss = obj(out)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss) / 1024  # KiB -> MiB
    params = sum(p.numel() for p in model.parameters()) / 1e6
    return {"objective": objective, "step_s": statistics.median(times), "peak_mib": peak,
            "params_m": params, "device": device.type}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--objectives", default="clip,xclip,nclip")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.preset, args.child, args.overrides, args.steps, args.warmup)))
        return

    rows = []
    for name in args.objectives.split(","):
        cmd = [sys.executable, __file__, "--preset", args.preset, "--child", name,
               "--steps", str(args.steps), "--warmup", str(args.warmup)]
        for o in args.overrides:
            cmd += ["--set", o]
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if out.returncode:
            sys.exit(f"{name} failed:\n{out.stderr[-2000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = next(r for r in rows if r["objective"] == "clip") if any(r["objective"] == "clip" for r in rows) else rows[0]
    print(f"preset={args.preset} overrides={args.overrides} device={rows[0]['device']}")
    print(f"{'objective':<10}{'params M':>10}{'step s':>10}{'x time':>8}{'peak MiB':>10}{'x mem':>8}")
    for r in rows:
        print(f"{r['objective']:<10}{r['params_m']:>10.2f}{r['step_s']:>10.4f}{r['step_s'] / base['step_s']:>8.2f}"
              f"{r['peak_mib']:>10.1f}{r['peak_mib'] / max(base['peak_mib'], 1e-9):>8.2f}")


if __name__ == "__main__":
    main()
