"""Generation speed of the synthetic scenes on one CPU core (no torch involved).

    python benchmarks/bench_data.py [--n 3000] [--image-size 64] [--repeats 3]

Prints samples/s (best and median of the repeats) and the ratio to the 2,000 samples/s target,
by wall clock and by this process's CPU time. The machines are shared: the CPU-time figure and
the best repeat are the ones least disturbed by other work.
"""

from __future__ import annotations

import os

# One thread everywhere before numpy loads: the figure is per core.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

TARGET = 2000.0  # samples/s at 64 px on one core


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=3000, help="samples per repeat")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    if hasattr(os, "sched_setaffinity"):  # pin to one core so the figure is one core's
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    from nclip.data.synthetic import SyntheticScenes

    ds = SyntheticScenes("train", length=args.n * args.repeats, image_size=args.image_size)
    for i in range(50):  # warm up imports and caches
        ds[i]
    wall, cpu = [], []
    for r in range(args.repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        for i in range(r * args.n, (r + 1) * args.n):  # fresh samples every repeat
            ds[i]
        wall.append(args.n / (time.perf_counter() - w0))
        cpu.append(args.n / (time.process_time() - c0))
    print(f"synthetic scenes, {args.image_size} px, 1 core, {args.n} samples x {args.repeats}")
    for name, rates in (("wall clock", wall), ("CPU time", cpu)):
        best, median = max(rates), statistics.median(rates)
        print(f"  {name:10s} best {best:6.0f} samples/s ({best / TARGET:.2f}x the {TARGET:.0f}/s "
              f"target), median {median:6.0f} ({median / TARGET:.2f}x)")

if __name__ == "__main__":
    main()
