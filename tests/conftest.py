import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


# Overrides that make any preset a seconds-long run (also for module-scoped fixtures, which cannot
# use the function-scoped fixture below).
MICRO_OVERRIDES = (
    "data.image_size=16", "data.text_length=16",
    "model.vision.patch_size=4", "model.vision.width=32", "model.vision.layers=1", "model.vision.heads=2",
    "model.text.width=32", "model.text.layers=1", "model.text.heads=2",
    "model.embed_dim=32", "model.nclip_hidden=64", "model.nclip_dim=128",
    "train.steps=6", "train.batch_size=8", "train.warmup_steps=1", "train.log_every=2",
    "train.checkpoint_every=3", "eval.samples=32", "eval.batch_size=32",
)


@pytest.fixture
def micro_overrides():
    """Overrides that make any preset a seconds-long run."""
    return list(MICRO_OVERRIDES)
