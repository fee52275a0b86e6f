"""On-disk cache of extracted features, keyed by the checkpoint's weights hash.

Layout: ``<root>/<sha256 of model.safetensors>[:16]/<entry>-<hash of identity>[:16].safetensors``.
An entry is a flat dict of tensors (safetensors: nothing is unpickled) whose metadata repeats
the full weights hash and the identity JSON, both checked on read, so a hash-prefix collision or a
stale file can never return the wrong features. Writes are atomic (temporary file + rename), so an
interrupted run leaves no half-written entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from nclip import fileperm

# bump when the content of an entry changes meaning (2: the eval resize truncates the long side,
# nclip.data.transforms.resize_center_crop; 3: head outputs keyed by head name, "clip" not "emb";
# 4: the centre crop rounds as torchvision's and a non-RGB image converts after it, data.eval_convention)
FORMAT = "nclip-eval-features/4"


def file_sha256(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def _identity_hash(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


class FeatureCache:
    """``get(entry, identity, compute)``: the cached tensors, or ``compute()``'s, stored on the way.

    ``root=None`` disables caching (everything is computed). ``hits`` / ``misses`` count lookups.
    """

    def __init__(self, root: str | Path | None, weights_sha256: str):
        self.root = Path(root) if root is not None else None
        self.weights = weights_sha256
        self.hits: list[str] = []
        self.misses: list[str] = []

    def path(self, entry: str, identity: dict) -> Path | None:
        if self.root is None:
            return None
        return self.root / self.weights[:16] / f"{entry}-{_identity_hash(identity)[:16]}.safetensors"

    def get(self, entry: str, identity: dict,
            compute: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        path = self.path(entry, identity)
        if path is not None and path.is_file():
            found = self._read(path, identity)
            if found is not None:
                self.hits.append(entry)
                return found
        self.misses.append(entry)
        tensors = compute()
        if path is not None:
            self._write(path, identity, tensors)
        return tensors

    def _read(self, path: Path, identity: dict) -> dict[str, torch.Tensor] | None:
        try:
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as fh:
                meta = fh.metadata() or {}
            if meta.get("format") != FORMAT or meta.get("weights_sha256") != self.weights \
                    or meta.get("identity") != json.dumps(identity, sort_keys=True, default=str):
                return None
            return load_file(str(path))
        except (SafetensorError, OSError, ValueError):  # a corrupt entry is recomputed, not fatal
            return None

    def _write(self, path: Path, identity: dict, tensors: dict[str, torch.Tensor]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"format": FORMAT, "weights_sha256": self.weights,
                "identity": json.dumps(identity, sort_keys=True, default=str)}
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
        try:
            save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp, metadata=meta)
            fileperm.settle(tmp)  # not mkstemp's (or safetensors') 0600: the umask's mode
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
