"""Time ProtoCLIP's per-episode prototype construction at the paper's scale (App. A.1, Tab. A.3).

One K-Means of N = 200,000 features of d = 128 dimensions (L2-normalised, like the projection-head
outputs) into K = 20,000 clusters with 20 iterations, and one Prototype Back Translation of the same
features through the resulting assignment. Targets on 2 CPU cores: K-Means < 2 min, PBT < 1 s.

Measured:

- ``two_level`` K-Means (nclip's CPU default at this scale, see :mod:`nclip.train.kmeans`):
  full 20 iterations;
- ``flat`` (exact Lloyd, Faiss): its per-iteration time from a 2-iteration run (a full run takes
  ~10 min on 2 cores), extrapolated to 20 iterations; ``--flat-full`` runs all 20;
- quality: the two methods' K-Means objectives (sum of squared distances) on a subsample
  (N/4 points into K/4 clusters, 20 iterations each), as a ratio;
- PBT: ``Fn.pbt`` (index_add + bincount, O(M + K)), median of 5, against Algorithm 1's loop over
  clusters (O(M·K)) timed on 200 clusters and extrapolated to K.

The features are synthetic: 4·K random directions on the sphere, each point one of them plus
Gaussian noise, renormalised (so clusters exist, as in trained projections).

    python benchmarks/bench_protoclip.py [--n 200000 --k 20000 --d 128 --iters 20 --threads 2]

``nclip bench`` has the K-Means and PBT rows of this (one method, scaled down on the CPU); this
script keeps the flat-vs-two-level comparison and the paper's full scale on the CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch


def features(n: int, d: int, k: int, seed: int = 0) -> np.ndarray:
    from nclip.bench.parts import sphere_features  # the same features as `nclip bench`'s K-Means row

    return sphere_features(n, d, k, seed)


CPU: dict = {}  # process CPU seconds of the last timed() call


def timed(fn):
    """(result, wall seconds); the process CPU seconds land in CPU["last"]. On a shared machine the
    wall time is inflated by other processes; CPU / threads is what 2 free cores would take if the
    work parallelised perfectly."""
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    CPU["last"] = time.process_time() - c0
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--k", type=int, default=20_000)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--flat-full", action="store_true", help="run the exact K-Means for all iterations")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args()

    import faiss

    from nclip.objectives import functional as Fn
    from nclip.train.kmeans import kmeans

    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    x = features(args.n, args.d, args.k)
    out: dict = {"n": args.n, "k": args.k, "d": args.d, "iters": args.iters, "threads": args.threads}
    print(f"K-Means of {args.n} x {args.d} float32 into {args.k} clusters, {args.iters} iterations, "
          f"{args.threads} threads (faiss {faiss.__version__})")

    res, t = timed(lambda: kmeans(x, args.k, niter=args.iters, method="two_level", seed=1))
    out["two_level_s"], out["two_level_cpu_s"], out["two_level_obj"] = t, CPU["last"], res.objective
    print(f"  two_level             {t:8.1f} s wall, {CPU['last']:.1f} s CPU   objective {res.objective:.1f}")

    flat_iters = args.iters if args.flat_full else 2
    flat, t = timed(lambda: kmeans(x, args.k, niter=flat_iters, method="flat", seed=1))
    # a run = init + iterations + one final assignment (~ one iteration): scale by (iters + 1) / (n + 1)
    est = t if args.flat_full else t * (args.iters + 1) / (flat_iters + 1)
    out["flat_s" if args.flat_full else "flat_est_s"] = est
    out["flat_measured_iters"], out["flat_measured_s"], out["flat_measured_cpu_s"] = flat_iters, t, CPU["last"]
    label = ("measured" if args.flat_full
             else f"estimated from {flat_iters} iterations in {t:.1f} s wall, {CPU['last']:.1f} s CPU")
    print(f"  flat (exact)          {est:8.1f} s   ({label})")
    print(f"  speed-up two_level vs flat: {est / out['two_level_s']:.1f}x")

    sub = features(args.n // 4, args.d, args.k // 4, seed=1)
    q_flat = kmeans(sub, args.k // 4, niter=args.iters, method="flat", seed=1).objective
    q_two = kmeans(sub, args.k // 4, niter=args.iters, method="two_level", seed=1).objective
    out["quality_n"], out["quality_k"] = args.n // 4, args.k // 4
    out["objective_ratio_two_level_over_flat"] = q_two / q_flat
    print(f"  quality ({args.n // 4} points, {args.k // 4} clusters): "
          f"objective two_level / flat = {q_two / q_flat:.3f}")

    feats, labels = torch.from_numpy(x), res.labels
    Fn.pbt(feats, labels, args.k)  # warm-up
    times = [timed(lambda: Fn.pbt(feats, labels, args.k, return_mask=True))[1] for _ in range(5)]
    out["pbt_s"] = statistics.median(times)
    sample = 200

    def loop_pbt():  # Algorithm 1's PBT, on the first `sample` clusters
        c = torch.zeros(sample, args.d)
        for j in range(sample):
            idx = torch.where(labels == j)[0]
            if len(idx):
                c[j] = feats[idx].mean(0)
        return c

    _, t_loop = timed(loop_pbt)
    out["pbt_loop_est_s"] = t_loop * args.k / sample
    print(f"PBT of {args.n} x {args.d} into {args.k} clusters: {out['pbt_s'] * 1000:.1f} ms (median of 5); "
          f"Algorithm 1's loop over clusters: ~{out['pbt_loop_est_s']:.1f} s "
          f"({out['pbt_loop_est_s'] / out['pbt_s']:.0f}x slower, from {sample} clusters)")
    import os

    out["loadavg_after"] = os.getloadavg()
    print(f"load average (1, 5, 15 min) at the end: {out['loadavg_after']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
