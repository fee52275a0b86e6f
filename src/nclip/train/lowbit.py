"""``train.optimizer: adamw8bit``: AdamW whose two moments are stored in 8 bits.

What it is for: xCLIP's two nCLIP heads (ViT-B/16 → 4096 → 32768, about 275 M parameters) carry
16 bytes per parameter in float32 training -- weights 4, gradients 4, AdamW's first and second
moments 4 + 4 -- about 4.4 GB, most of xCLIP's memory over CLIP (docs/performance.md). Storing the
moments block-wise quantised in 8 bits (one uint8 code per value and one float32 scale per block
of 256: about 2.03 bytes for both moments instead of 8) saves about 6 bytes per parameter.

The update is torchao's ``AdamW8bit`` (Dettmers et al., "8-bit Optimizers via Block-wise
Quantization"; dynamic-tree quantisation maps), not ours: the moments are dequantised to float32,
updated with AdamW's equations, and requantised, in a ``torch.compile``-d kernel per parameter
shape (the first step compiles, about a second per distinct shape; on the CPU Inductor needs a C++
compiler). Tensors under 4,096 values (biases, norms, the logit scale) keep float32 moments. The
weights, gradients, the objective and its float32 arithmetic are unchanged.

Checkpoints hold the 8-bit state as it is (torchao's state tensors load with
``torch.load(weights_only=True)``), so resume stays exact. Not with ``train.strategy: fsdp``,
which shards the full optimizer state already (the config refuses the pair).
"""

from __future__ import annotations

import warnings

import torch

from nclip.config import TrainConfig


def adamw8bit(groups: list[dict], cfg: TrainConfig) -> torch.optim.Optimizer:
    """torchao's AdamW8bit over ``groups`` (nclip.train.optim.param_groups: per-group weight decay)
    with the run's betas and eps."""
    AdamW8bit = _import_adamw8bit()
    return AdamW8bit(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)


def _import_adamw8bit():
    # torch warns that torchao's state tensors define no cache key for compiled autograd (nclip's
    # logger levels set in nclip/__init__.py quiet torchao's own import warnings)
    warnings.filterwarnings("ignore", message=".*_stable_hash_for_caching.*")
    from torchao.optim import AdamW8bit

    return AdamW8bit
