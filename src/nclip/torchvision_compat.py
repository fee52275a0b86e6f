"""torchvision importable beside torch's CPU wheel, in any process that has imported nclip.

transformers' image utilities, open_clip, OpenAI's CLIP code and CLIP_benchmark import torchvision wherever it
is installed. PyPI's x86-64 torchvision is built against CUDA torch: its C++ extension links
``libtorch_cuda.so`` and does not load beside the CPU wheel of torch that this project pins (the Makefile's
torch 2.13.0; ``torchvision==0.28.0`` is the release built for it, a dev dependency of the parity tests).
torchvision shrugs a failed extension off, but its ``_meta_registrations`` then registers fake kernels for
``torchvision::nms`` and ``torchvision::qnms``, operators only the extension defines, and ``import
torchvision`` stops with "operator torchvision::nms does not exist" -- and with it every transformers model
and every peer tool.

``import nclip`` puts a finder on ``sys.meta_path`` (:func:`install`) that imports nothing itself: only when
something imports torchvision does it run torchvision's own import, and where that fails in this way it
declares the two operators' schemas -- never called: nclip uses no torchvision operator -- and runs it again.
So torchvision still loads only where another package asks for it, and ``import nclip`` then ``import
open_clip`` works in one process.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_declared = []  # the Library object must outlive the import for the schemas to stay


def _declare_missing_operators() -> None:
    import torch

    lib = torch.library.Library("torchvision", "DEF")
    for op in ("nms", "qnms"):
        lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _declared.append(lib)


class _RetryingLoader(importlib.abc.Loader):
    """torchvision's own loader; where its import stops for the missing operators, they are declared and
    the package runs again from a clean slate."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        try:
            self.loader.exec_module(module)
        except RuntimeError as e:
            if "torchvision::nms" not in str(e) or _declared:
                raise
            for name in [m for m in sys.modules if m.startswith("torchvision.")]:
                del sys.modules[name]
            _declare_missing_operators()
            self.loader.exec_module(module)


class _TorchvisionFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torchvision":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _RetryingLoader(spec.loader)
        return spec


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once); a no-op where torchvision is already imported."""
    if "torchvision" not in sys.modules and not any(isinstance(f, _TorchvisionFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchvisionFinder())
