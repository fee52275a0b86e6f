"""nclip: language-image pre-training beyond the contrastive objective."""

__version__ = "0.1.0"
