"""nclip: language-image pre-training beyond the contrastive objective."""

import logging

from nclip import torchvision_compat as _torchvision_compat

__version__ = "0.1.0"

# transformers imports torchao whenever it is installed (nclip[lowmem]); torchao then logs one warning
# per CUDA kernel library a CPU build cannot load, and torch one per enum torchao registers. Neither
# concerns nclip's use (the 8-bit optimizer, nclip.train.lowbit), so both loggers show errors only.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)

# a CUDA-built torchvision beside the CPU torch wheel: made importable when something imports it
_torchvision_compat.install()


def load(path, device=None, arch=None, trust_plugin=False):
    """A trained model for inference, OpenCLIP-style: ``encode_image``, ``encode_text``,
    ``zero_shot``, ``tokenizer``, ``transform`` (see :func:`nclip.api.load`); also an OpenCLIP or
    OpenAI checkpoint (``arch``: the open_clip config of a state-dict file; without it, the file's
    architecture is read from its tensors as OpenAI's). ``trust_plugin``: import the objective plugin
    its config names from the working directory (docs/plugins.md). Imported lazily, so
    ``import nclip`` stays fast."""
    from nclip.api import load as _load

    return _load(path, device, arch, trust_plugin=trust_plugin)


def __getattr__(name: str):
    """``nclip.Index`` (write an ``nclip embed`` directory with ``Index.build``, search one opened with
    ``Index.open``), imported on first use so that ``import nclip`` loads no torch. (``nclip.embed``
    is the package, so the function that writes is :func:`nclip.embed.writer.embed`.)"""
    if name == "Index":
        from nclip.embed.index import Index

        return Index
    raise AttributeError(f"module 'nclip' has no attribute {name!r}")


def merge(a, b, alpha, out, force=False, trust_plugin=False):
    """WiSE-FT weight interpolation: write (1 − α)·A + α·B (two run or model directories of one
    architecture) as the nclip model directory ``out`` and return its path (see
    :func:`nclip.models.merge.merge`; ``trust_plugin`` as :func:`load`'s). Imported lazily, as
    :func:`load`."""
    from nclip.models.merge import merge as _merge
    from nclip.plugin_consent import consent

    with consent(trust_plugin):
        return _merge(a, b, alpha, out, force)
