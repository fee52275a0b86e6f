"""The memory of xCLIP's heads and objective on a whole global batch, at the paper's sizes.

With exact accumulation (nclip.train.accumulate) the towers run one micro-batch at a time, but the
heads and the objective run once on the whole global batch: their activations are what grows with
B. This measures them on the CPU, in float32 (an upper bound for bf16 towers: the objective runs in
float32 either way), for the ``vit-b16-xclip`` heads (features 768/512 → CLIP 512, nCLIP 4096 →
32768 per modality) at a few batch sizes, one fresh process per point (peak RSS growth, from a reset peak, of one
forward + backward of ``HeadPass`` on random tower features), and fits peak = a + b·B.

    python benchmarks/heads_memory.py --batches 128 256 512
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import subprocess
import sys

from nclip.bench.objective_cost import _peak_rss_kib, _reset_peak_rss


def measure(batch: int) -> float:
    """MiB of peak RSS growth of one heads + objective step at ``batch`` (run in this process)."""
    import torch

    from nclip.config import resolve
    from nclip.models import build_model
    from nclip.objectives import build_objective
    from nclip.train.step import HeadPass, TrainStep

    torch.set_num_threads(1)
    cfg = resolve("vit-b16-xclip")
    model = build_model(cfg, pretrained_text=False)
    step = TrainStep(model, build_objective(cfg.objective, cfg))
    heads = HeadPass(step)
    feats = {"image": torch.randn(batch, model.vision.width, requires_grad=True),
             "text": torch.randn(batch, model.text.width, requires_grad=True)}
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # give the build's freed heap back, so the step's pages are new
    before = _reset_peak_rss()  # a peak reached while the model was built must not hide the step's
    heads(feats, None)["loss"].backward()  # xCLIP reads no per-row tensor of the batch
    return (_peak_rss_kib() - before) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--point", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.point:
        print(json.dumps({"batch": args.point, "mib": measure(args.point)}))
        return
    points = []
    for b in args.batches:
        out = subprocess.run([sys.executable, __file__, "--point", str(b)], capture_output=True, text=True, check=True)
        points.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(points[-1], flush=True)
    n = len(points)
    mx = sum(p["batch"] for p in points) / n
    my = sum(p["mib"] for p in points) / n
    slope = sum((p["batch"] - mx) * (p["mib"] - my) for p in points) / sum((p["batch"] - mx) ** 2 for p in points)
    fixed = my - slope * mx
    print(json.dumps({"mib_per_sample": slope, "fixed_mib": fixed,
                      "at_4096_gib": (fixed + slope * 4096) / 1024}))


if __name__ == "__main__":
    main()
