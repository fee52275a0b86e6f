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
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import torch

from nclip.errors import SourceError

STORAGES = {"FloatStorage": torch.float32, "HalfStorage": torch.float16, "DoubleStorage": torch.float64,
            "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
            "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
            "BoolStorage": torch.bool}
LIST_BUILDERS = ("build_intlist", "build_tensorlist", "build_doublelist", "build_boollist", "build_empty_list")


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
            data = bytearray(self._zf.read(f"{self._root}/data/{key}"))
            flat = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
            if flat.numel() < numel:
                raise pickle.UnpicklingError(f"record data/{key} holds {flat.numel()} values, not {numel}")
            self._storages[key] = flat
        return self._storages[key]


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
    out: dict[str, torch.Tensor] = {}
    _collect(top, "", out, set())
    return out


def _collect(obj, prefix: str, out: dict, seen: set) -> None:
    if not isinstance(obj, _Module) or id(obj) in seen:
        return
    seen.add(id(obj))
    state = getattr(obj, "state", None)
    for key, value in (state.items() if isinstance(state, dict) else ()):
        if isinstance(value, torch.Tensor):
            out[prefix + key] = value.clone()
        else:
            _collect(value, f"{prefix}{key}.", out, seen)
