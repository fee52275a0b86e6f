"""nclip: language-image pre-training beyond the contrastive objective."""

__version__ = "0.1.0"


def load(path, device=None):
    """A trained model for inference, OpenCLIP-style: ``encode_image``, ``encode_text``,
    ``zero_shot``, ``tokenizer``, ``transform`` (see :func:`nclip.api.load`). Imported lazily, so
    ``import nclip`` stays fast."""
    from nclip.api import load as _load

    return _load(path, device)
