"""K-Means for ProtoCLIP's prototypes (Sec. 3.1, Eq. 2; App. A.1: Faiss K-Means, 20 iterations).

:func:`kmeans` returns the K centroids, every point's cluster (its nearest centroid) and the
K-Means objective (sum of squared distances). Methods:

- ``flat``: Faiss' exact Lloyd K-Means (``faiss.Kmeans``) over all points, on the GPU when Faiss
  has one. Each iteration assigns every point to its nearest centroid exactly: N·K·d multiply-adds.
  At the paper's scale (N = 200,000, K = 20,000, d = 128) that is 10 TFLOP for 20 iterations,
  seconds on a GPU but ~10 minutes on 2 CPU cores.
- ``two_level``: hierarchical K-Means for large K on CPUs: K-Means into k1 = ⌈√K⌉ coarse cells,
  then, inside every cell, K-Means into a share of the K clusters proportional to the cell's size
  (at least 1, at most its number of points) -- the approach of
  ``faiss.contrib.clustering.two_level_clustering``. Points cannot change cells there, so
  ``REFINE_ITERS`` global Lloyd iterations follow in which each point is assigned to its nearest
  centroid among those of its ``NPROBE`` nearest cells (a Faiss IVF index over the centroids), and
  the final assignment is made the same way. Cost ≈ N·(2√K + NPROBE·√K)·d per iteration instead of
  N·K·d (≈50× less at the paper's scale); the objective stays a few percent above the flat one's
  (``benchmarks/bench_protoclip.py`` measures both).
- ``auto``: ``flat`` on a GPU or when N·K ≤ 2.5e8 (about a second per iteration on a CPU),
  else ``two_level``.

``niter = 0`` is ProtoCLIP's "w/o K-Means" ablation (Tab. 1(a), Sec. 4.2: "K-Means optimizing"
removed): the prototypes are what Lloyd's iterations would start from, K distinct training points
drawn uniformly at random (Faiss' initialisation), kept as they are; every point is then assigned
to its nearest one exactly. The method reported is ``random`` whatever ``method`` asked for.

``nredo`` runs the clustering that many times from different seeds and keeps the lowest
objective (Faiss' ``nredo``). Deterministic for a given seed on the CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

AUTO_FLAT_MAX_WORK = 2.5e8  # N·K below which the exact method is cheap enough on a CPU
REFINE_ITERS = 3  # two_level: global Lloyd iterations over the NPROBE nearest cells
NPROBE = 8


@dataclass
class KMeansResult:
    centroids: torch.Tensor  # [K, d] float32
    labels: torch.Tensor  # [N] int64, each point's cluster
    objective: float  # Σ_i ||x_i − c_{labels_i}||²
    method: str  # the method that ran: flat | two_level | random (niter = 0)


def faiss_gpus() -> int:
    import faiss

    get = getattr(faiss, "get_num_gpus", None)
    return int(get()) if get is not None else 0


def kmeans(
    x: np.ndarray | torch.Tensor,
    k: int,
    *,
    niter: int = 20,
    nredo: int = 1,
    seed: int = 0,
    method: str = "auto",
) -> KMeansResult:
    """K-Means of ``x`` [N, d] into ``k`` clusters (1 <= k <= N); see the module docstring.
    ``niter`` = 0: k random points as the centroids, no Lloyd iteration (ProtoCLIP's "w/o K-Means")."""
    x = _as_float32(x)
    n, d = x.shape
    if not 1 <= k <= n:
        raise ValueError(f"k must lie in [1, {n}] (the number of points), got {k}")
    if method not in ("auto", "flat", "two_level"):
        raise ValueError(f"unknown K-Means method {method!r}; use auto, flat or two_level")
    if niter < 0 or nredo < 1:
        raise ValueError(f"niter must be >= 0 and nredo >= 1, got {niter} and {nredo}")
    if niter == 0:
        centroids, labels, obj = _random_centroids(x, k, nredo, seed)
        return KMeansResult(torch.from_numpy(centroids), torch.from_numpy(labels), float(obj), "random")
    gpu = faiss_gpus() > 0
    if method == "auto":
        method = "flat" if gpu or n * k <= AUTO_FLAT_MAX_WORK or k < 4 else "two_level"
    if method == "flat":
        centroids, labels, obj = _flat(x, k, niter, nredo, seed, gpu)
    else:
        centroids, labels, obj = _two_level(x, k, niter, nredo, seed)
    return KMeansResult(torch.from_numpy(centroids), torch.from_numpy(labels.astype(np.int64)), float(obj), method)


def _as_float32(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"expected a 2-D array [N, d], got shape {x.shape}")
    return x


def _faiss_kmeans(x: np.ndarray, k: int, niter: int, nredo: int, seed: int, gpu: bool = False):
    """(centroids [k, d], labels [n], objective) of Faiss' exact K-Means over all of ``x``."""
    import faiss

    n, d = x.shape
    if k == 1:
        c = x.mean(0, keepdims=True)
        return c, np.zeros(n, np.int64), float(((x - c) ** 2).sum())
    if k == n:
        return x.copy(), np.arange(n), 0.0
    km = faiss.Kmeans(d, k, niter=niter, nredo=nredo, seed=seed, gpu=gpu, verbose=False,
                      max_points_per_centroid=n,  # cluster every point: no subsampling
                      min_points_per_centroid=1)  # no warning for few points per centroid
    km.train(x)
    dist, labels = km.index.search(x, 1)  # final assignment to the final centroids
    return km.centroids.copy(), labels[:, 0].astype(np.int64), float(dist.sum())


def _random_centroids(x: np.ndarray, k: int, nredo: int, seed: int):
    """(centroids [k, d], labels [n], objective): k distinct points of ``x`` drawn uniformly (as Faiss
    seeds Lloyd's iterations), each point assigned to its nearest one by an exact search; of
    ``nredo`` draws the one with the lowest objective."""
    import faiss

    rng = np.random.default_rng(seed)
    best = None
    for _ in range(nredo):
        centroids = x[np.sort(rng.choice(x.shape[0], k, replace=False))].copy()
        index = faiss.IndexFlatL2(x.shape[1])
        index.add(centroids)
        dist, labels = index.search(x, 1)
        obj = float(dist.sum())
        if best is None or obj < best[2]:
            best = (centroids, labels[:, 0].astype(np.int64), obj)
    return best


def _flat(x, k, niter, nredo, seed, gpu):
    return _faiss_kmeans(x, k, niter, nredo, seed, gpu)


def allocate(sizes: np.ndarray, k: int) -> np.ndarray:
    """Clusters per cell: proportional to ``sizes`` (largest remainders), each in [1, size], summing
    to ``k`` (requires len(sizes) <= k <= sizes.sum())."""
    sizes = np.asarray(sizes, dtype=np.int64)
    share = sizes * k / sizes.sum()
    alloc = np.clip(np.floor(share).astype(np.int64), 1, sizes)
    while alloc.sum() < k:  # give to the cells furthest below their share that still have room
        room = alloc < sizes
        gap = np.where(room, share - alloc, -np.inf)
        alloc[int(np.argmax(gap))] += 1
    while alloc.sum() > k:  # take from the cells furthest above their share that keep >= 1
        spare = alloc > 1
        over = np.where(spare, alloc - share, -np.inf)
        alloc[int(np.argmax(over))] -= 1
    return alloc


def _two_level(x: np.ndarray, k: int, niter: int, nredo: int, seed: int):
    n, d = x.shape
    k1 = min(int(math.ceil(math.sqrt(k))), k)
    coarse, cell, _ = _faiss_kmeans(x, k1, niter, nredo, seed)
    sizes = np.bincount(cell, minlength=k1)
    occupied = np.flatnonzero(sizes)  # Faiss may leave a coarse cell empty
    per_cell = allocate(sizes[occupied], k)
    order = np.argsort(cell, kind="stable")
    starts = np.concatenate([[0], np.cumsum(sizes)])
    centroids = np.empty((k, d), np.float32)
    labels = np.empty(n, np.int64)
    obj, offset = 0.0, 0
    for j, c in enumerate(occupied):
        members = order[starts[c] : starts[c + 1]]
        kc = int(per_cell[j])
        cent, lab, o = _faiss_kmeans(x[members], kc, niter, nredo, seed + 1 + int(c))
        centroids[offset : offset + kc] = cent
        labels[members] = lab + offset
        obj += o
        offset += kc
    if REFINE_ITERS and k1 > 1:
        return _refine(x, centroids, coarse, REFINE_ITERS, min(NPROBE, k1))
    return centroids, labels, obj


def _refine(x: np.ndarray, centroids: np.ndarray, coarse: np.ndarray, iters: int, nprobe: int):
    """``iters`` Lloyd iterations, each point assigned to its nearest centroid among those in its
    ``nprobe`` nearest coarse cells, then that assignment to the final centroids."""
    import faiss

    n, d = x.shape
    k = centroids.shape[0]
    xt = torch.from_numpy(x)
    for it in range(iters + 1):
        quantizer = faiss.IndexFlatL2(d)
        quantizer.add(coarse)
        index = faiss.IndexIVFFlat(quantizer, d, coarse.shape[0])
        index.is_trained = True  # the quantizer holds the coarse centroids already
        index.add(centroids)
        index.nprobe = nprobe
        dist, idx = index.search(x, 1)
        labels, dist = idx[:, 0], dist[:, 0]
        lost = labels < 0  # no centroid in the probed cells (practically never): exact search
        if lost.any():
            flat = faiss.IndexFlatL2(d)
            flat.add(centroids)
            dl, il = flat.search(x[lost], 1)
            labels[lost], dist[lost] = il[:, 0], dl[:, 0]
        if it == iters:
            break
        lab = torch.from_numpy(labels.astype(np.int64))
        sums = torch.zeros(k, d).index_add_(0, lab, xt)
        counts = torch.bincount(lab, minlength=k)
        filled = counts > 0  # an emptied centroid stays where it was
        c = torch.from_numpy(centroids)
        c[filled] = sums[filled] / counts[filled, None].float()
        centroids = c.numpy()
    return centroids, labels.astype(np.int64), float(dist.sum())
