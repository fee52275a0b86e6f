"""The stored vectors as the index reads them: the float16 shards joined in row order, ℓ2-normalised
float32 rows, and the exact inner-product Faiss index over them (so its score is the cosine)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from nclip.errors import NclipError


def load_shards(directory: Path, doc: dict, kind: str) -> np.ndarray:
    """[N, D] float32: the ``kind`` ("images" or "texts") shards of a manifest, in row order."""
    names = [s[kind] for s in doc["shards"] if kind in s]
    if len(names) != len(doc["shards"]):
        raise NclipError(f"{directory}: holds no {kind[:-1]} embeddings")
    return np.concatenate([np.load(directory / name) for name in names]).astype(np.float32)


def normalised(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to unit ℓ2 norm (float32, C order: what Faiss takes); zero rows stay zero."""
    v = np.ascontiguousarray(vectors, dtype=np.float32)
    return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)


def build_faiss(directory: Path, doc: dict):
    """An exact inner-product Faiss index over the ℓ2-normalised image embeddings of a manifest's
    shards, added shard by shard (one shard in memory at a time, besides the index)."""
    import faiss

    index = None
    for shard in doc["shards"]:
        vectors = normalised(np.load(directory / shard["images"]))
        index = index or faiss.IndexFlatIP(vectors.shape[1])
        index.add(vectors)
    return index
