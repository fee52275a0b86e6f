"""The tensors of a TorchScript archive (OpenAI's CLIP ``.pt`` files) read without running its code.

``torch.jit.load`` compiles and runs the TorchScript code an archive carries, and ``torch.load``
hands such an archive to it (``weights_only=True`` refuses it): loading a file that way trusts its
author. The archive is a zip: ``data.pkl`` pickles the module tree (an object of a ``__torch__.*``
class per module, its attributes in a dict: parameters, buffers, submodules, plain values) and each
tensor's bytes are a record ``data/KEY``. This reader unpickles ``data.pkl`` with a ``find_class``
that hands out only inert stand-ins -- an empty class for every ``__torch__.*`` name, a dtype for
each storage type, a view maker for ``torch._utils._rebuild_tensor_v2``, the identity for
TorchScript's list builders -- and refuses every other global, as ``torch.load(weights_only=True)``
does for ordinary checkpoints; tensors come from the records. Nothing in the archive is executed.

The result is the module tree's tensors by dotted name (``visual.conv1.weight``, ...), what the
scripted module's ``state_dict()`` holds, plus any tensor-valued plain attributes (OpenAI's
``attn_mask``), which the caller ignores.

What a damaged or hostile archive can make it do is bounded, each bound a one-line refusal: a
record must inflate to exactly the bytes its tensor takes (so a compressed record that would
inflate to gigabytes is refused before it is read), the records together to no more than the
machine's memory, and the module tree may be at most ``MAX_DEPTH`` modules deep (OpenAI's are 7).
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import torch

from nclip.errors import SourceError
from nclip.models.size_check import machine_memory

STORAGES = {"FloatStorage": torch.float32, "HalfStorage": torch.float16, "DoubleStorage": torch.float64,
            "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
            "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
            "BoolStorage": torch.bool}
LIST_BUILDERS = ("build_intlist", "build_tensorlist", "build_doublelist", "build_boollist", "build_empty_list")
MAX_DEPTH = 100  # modules within modules (visual.transformer.resblocks.0.attn.out_proj is 6)
_CHUNK = 1 << 24  # a record is inflated into its tensor's buffer this many bytes at a time


def is_torchscript(path: Path) -> bool:
    """A zip whose top folder holds ``data.pkl`` and TorchScript's ``code/`` (a ``torch.save`` zip has no code)."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
    return any(n.endswith("/data.pkl") and n.count("/") == 1 for n in names) and any("/code/" in n for n in names)


class _Module:
    """Stand-in for a ``__torch__.*`` object: keeps the attribute dict it is built with."""

    def __setstate__(self, state):
        self.state = state


def _rebuild(storage: torch.Tensor, offset: int, size, stride, *_ignored) -> torch.Tensor:
    return torch.as_strided(storage, tuple(size), tuple(stride), offset)


def _same(value, *_ignored):
    return value


class _Unpickler(pickle.Unpickler):
    def __init__(self, fh, zf: zipfile.ZipFile, root: str):
        super().__init__(fh)
        self._zf, self._root, self._storages = zf, root, {}
        memory = machine_memory()
        self._budget = memory[0] if memory is not None else None  # bytes the records may still take

    def find_class(self, module: str, name: str):
        if module.startswith("__torch__"):
            return type(name, (_Module,), {})
        if module == "torch" and name in STORAGES:
            return STORAGES[name]
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if module == "torch.jit._pickle" and (name in LIST_BUILDERS or name == "restore_type_tag"):
            return _same
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        raise pickle.UnpicklingError(f"unexpected global {module}.{name}")

    def persistent_load(self, pid):
        kind, dtype, key, _location, numel = pid
        if kind != "storage" or not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        if key not in self._storages:
            self._storages[key] = self._record(key, dtype, numel)
        return self._storages[key]

    def _record(self, key, dtype: torch.dtype, numel) -> torch.Tensor:
        """The ``numel`` values of record ``data/KEY``, after its size is checked against theirs."""
        if not isinstance(numel, int) or numel < 0:
            raise pickle.UnpicklingError(f"record data/{key}: a storage of {numel!r} values")
        info = self._zf.getinfo(f"{self._root}/data/{key}")
        size = numel * dtype.itemsize
        if info.file_size != size:
            raise pickle.UnpicklingError(f"record data/{key} inflates to {info.file_size:,} bytes, where its "
                                         f"{numel:,} values take {size:,}")
        if self._budget is not None:
            self._budget -= size
            if self._budget < 0:
                raise pickle.UnpicklingError(f"its tensors take more than this machine's memory (record data/{key}, "
                                             f"{size:,} bytes)")
        data = bytearray(size)
        view, done = memoryview(data), 0
        with self._zf.open(info) as fh:  # into the one buffer: no second copy of a large record
            while done < size:
                chunk = fh.read(min(_CHUNK, size - done))
                if not chunk:
                    raise pickle.UnpicklingError(f"record data/{key} ends after {done:,} of {size:,} bytes")
                view[done:done + len(chunk)] = chunk
                done += len(chunk)
        return torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the archive's module tree by dotted name (copies, float as stored)."""
    try:
        with zipfile.ZipFile(path) as zf:
            root = next(n for n in zf.namelist() if n.endswith("/data.pkl") and n.count("/") == 1).split("/")[0]
            with zf.open(f"{root}/data.pkl") as fh:
                top = _Unpickler(fh, zf, root).load()
    except (StopIteration, KeyError, zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError,
            RuntimeError, TypeError, AttributeError) as e:
        raise SourceError(path, f"cannot read it as a TorchScript archive: {type(e).__name__}: {e}") from None
    return _collect(top, path)


def _collect(top, path: Path) -> dict[str, torch.Tensor]:
    """The tensors of the module tree under ``top`` by dotted name, walked with a stack of its own
    (a tree deeper than Python's recursion limit is data, not a crash) to ``MAX_DEPTH`` modules."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    stack = [(top, "", 0)]
    while stack:
        obj, prefix, depth = stack.pop()
        if not isinstance(obj, _Module) or id(obj) in seen:
            continue
        if depth > MAX_DEPTH:
            raise SourceError(path, f"cannot read it as a TorchScript archive: its module tree is more than "
                              f"{MAX_DEPTH} modules deep (at {prefix[:80]}...)")
        seen.add(id(obj))
        state = getattr(obj, "state", None)
        children = []
        for key, value in (state.items() if isinstance(state, dict) else ()):
            if isinstance(value, torch.Tensor):
                out[prefix + key] = value.clone()
            else:
                children.append((value, f"{prefix}{key}.", depth + 1))
        stack.extend(reversed(children))  # in the order the recursive walk took
    return out
