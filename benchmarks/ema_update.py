"""The EMA update of train.ema (nclip.train.ema.WeightEMA: one torch._foreach_lerp_ with a device
weight, gated by the step's skip flag) against torch.optim.swa_utils.AveragedModel with
get_ema_multi_avg_fn, on the CPU, for the `tiny` preset's model. Prints ms per update and the ratio.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/ema_update.py [--preset tiny] [--repeats 200]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from nclip.config import resolve
from nclip.models import build_model
from nclip.train.ema import WeightEMA


def _time(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build_model(resolve(args.preset, ["train.device=cpu"]), pretrained_text=False)
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ours = WeightEMA(model, 0.999)
    taken = torch.tensor(1.0)
    theirs = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999), use_buffers=False)
    theirs.update_parameters(model)  # the first call copies
    a = _time(lambda: ours.update(taken), args.repeats)
    b = _time(lambda: theirs.update_parameters(model), args.repeats)
    print(f"{args.preset}: {n / 1e6:.2f}M trainable parameters")
    print(f"WeightEMA (_foreach_lerp_, gated)           {a:8.3f} ms/update")
    print(f"AveragedModel + get_ema_multi_avg_fn        {b:8.3f} ms/update  ({b / a:.2f}x ours)")


if __name__ == "__main__":
    main()
