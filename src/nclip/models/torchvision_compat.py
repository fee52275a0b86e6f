"""torchvision importable beside torch's CPU wheel, for transformers (which imports it wherever it is installed).

transformers' CLIP classes import its image utilities, which import torchvision when it is installed.
PyPI's x86-64 torchvision is built against CUDA torch: its C++ extension links ``libtorch_cuda.so``
and does not load beside the CPU wheel of torch that this project pins (the Makefile's torch 2.13.0;
``torchvision==0.28.0`` is the release built for it, a dev dependency of the OpenCLIP tests).
torchvision shrugs a failed extension off, but its ``_meta_registrations`` then registers fake
kernels for ``torchvision::nms`` and ``torchvision::qnms``, operators only the extension defines,
and ``import torchvision`` stops with "operator torchvision::nms does not exist" -- and with it
every transformers model.

:func:`ensure_importable` imports torchvision once (what transformers would do anyway); where it fails
that way, it declares the two operators' schemas -- never called: nclip uses no torchvision operator --
and imports it again. Without torchvision it does nothing.
"""

from __future__ import annotations

import importlib.util
import sys

_declared = []  # the Library object must outlive the import for the schemas to stay


def ensure_importable() -> None:
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is None:
        return
    try:
        import torchvision  # noqa: F401
    except RuntimeError as e:
        if "torchvision::nms" not in str(e):
            raise
        import torch

        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        lib = torch.library.Library("torchvision", "DEF")
        for op in ("nms", "qnms"):
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _declared.append(lib)
        import torchvision  # noqa: F401, F811
