"""The stored vectors as the index reads them: the float16 shards joined in row order, ℓ2-normalised
float32 rows, and the exact inner-product Faiss index over them (so its score is the cosine).

A file that is not as ``nclip embed`` wrote it (truncated, another directory's, not an array or
an index at all) is one line naming it and the command that rebuilds the directory
(:func:`nclip.embed.manifest.damaged`), never a numpy or Faiss exception."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from nclip.embed.manifest import INDEX, damaged
from nclip.errors import NclipError

# An IndexFlat file is its float32 vectors and a header (45 bytes in faiss 1.x; room for another
# version's): a file whose size is far from that is refused before Faiss parses it, since a
# damaged header can make Faiss allocate whatever size it claims.
FAISS_HEADER_BYTES = 1024


def load_shards(directory: Path, doc: dict, kind: str) -> np.ndarray:
    """[N, D] float32: the ``kind`` ("images" or "texts") shards of a manifest, in row order."""
    names = [s[kind] for s in doc["shards"] if kind in s]
    if len(names) != len(doc["shards"]):
        raise NclipError(f"{directory}: holds no {kind[:-1]} embeddings")
    return np.concatenate([read_shard(directory, doc, s[kind], s["rows"]) for s in doc["shards"]]).astype(np.float32)


def read_shard(directory: Path, doc: dict, name: str, rows: int) -> np.ndarray:
    """The [rows, D] array of one shard file (D: the manifest's ``dim`` once the index is written).
    Memory-mapped first, so that a header claiming more than the file holds fails without
    allocating it; ``np.load`` never unpickles."""
    try:
        mapped = np.load(directory / name, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise damaged(directory, doc, name, "not found") from None
    except (ValueError, OSError, EOFError) as e:
        raise damaged(directory, doc, name, f"not a readable .npy array ({_first_line(e)})") from None
    if not isinstance(mapped, np.ndarray) or mapped.dtype.kind != "f" or mapped.ndim != 2:
        raise damaged(directory, doc, name, "not a 2-d float array")
    dim = doc.get("dim", mapped.shape[1])  # the manifest has no dim before the index is written
    if list(mapped.shape) != [rows, dim]:
        raise damaged(directory, doc, name, f"holds an array of shape {list(mapped.shape)}, the manifest says "
                      f"[{rows}, {dim}]")
    return np.array(mapped)


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
        vectors = normalised(read_shard(directory, doc, shard["images"], shard["rows"]))
        index = index or faiss.IndexFlatIP(vectors.shape[1])
        index.add(vectors)
    return index


def read_faiss(directory: Path, doc: dict):
    """The Faiss index of a finished directory, checked to hold the manifest's rows and dimension."""
    import faiss

    path, rows, dim = directory / INDEX, doc["rows"], doc["dim"]
    if not path.is_file():
        raise damaged(directory, doc, INDEX, "not found")
    size, vectors = path.stat().st_size, 4 * rows * dim
    if not vectors < size <= vectors + FAISS_HEADER_BYTES:
        raise damaged(directory, doc, INDEX, f"{size} bytes, where {rows} vectors of {dim} dims take "
                      f"{vectors} bytes and a header (truncated, or another directory's?)")
    try:
        index = faiss.read_index(str(path))
    except (RuntimeError, MemoryError) as e:  # Faiss raises RuntimeError for every unreadable file
        raise damaged(directory, doc, INDEX, f"not a Faiss index ({_first_line(e).rsplit(': ', 1)[-1][:80]})") from None
    if (index.ntotal, index.d) != (rows, dim):
        raise damaged(directory, doc, INDEX, f"holds {index.ntotal} vectors of {index.d} dims, the manifest "
                      f"{rows} of {dim}")
    return index


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__
