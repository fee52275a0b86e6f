"""CLIP's modified ResNet image tower, ``model.vision.kind: clip_resnet``.

Radford et al. 2021, Sec. 2.4, and ProtoCLIP's App. A.1 (its image encoder, "following CLIP")
describe three changes to He et al.'s ResNet, all here:

1. the stem is three 3×3 convolutions (the first of stride 2; ``embedding_size``/2,
   ``embedding_size``/2 and ``embedding_size`` channels, each followed by BatchNorm and ReLU), then
   a 2×2 *average* pool where He et al. have one 7×7 convolution and a max pool;
2. anti-aliased strides (Zhang 2019's "rect-2" blur pooling): a block that halves the map does so
   with a 2×2 average pool *before* a stride-1 convolution, in the residual branch (between the 3×3
   and the last 1×1 convolution) and in the shortcut (before its 1×1 projection);
3. the global average pool is replaced by attention pooling: one multi-head QKV attention whose
   query is the mean of the last feature map, over that mean and the flattened map, each with a
   learned position embedding; its output is projected to ``pool_dim`` (the feature).

Written from those descriptions; the initialisation follows the released model's: the last
BatchNorm of every residual branch starts at γ = 0 (each block starts as its shortcut), the pool's
projections at N(0, 1/C).

Gradient checkpointing and FSDP units are per stage, as for the transformers ResNet
(:class:`nclip.models.towers.ResNetTower`); every BatchNorm is a plain ``nn.BatchNorm2d``, which
``model.sync_batchnorm`` converts like any other. Mask probing reads the pool's attention
(:meth:`ClipResNetTower.attention_maps`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from nclip.config.model import VisionConfig, clip_resnet_grid
from nclip.errors import NclipError
from nclip.models import pixel_stats, recompute

EXPANSION = 4  # a bottleneck's output channels over its 3×3 convolution's


def _conv_bn_relu(c_in: int, c_out: int, kernel: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, kernel, stride, padding=kernel // 2, bias=False), nn.BatchNorm2d(c_out),
            nn.ReLU(inplace=True)]


class Bottleneck(nn.Module):
    """relu(branch(x) + shortcut(x)): 1×1 → 3×3 → [2×2 avg pool] → 1×1 (×4 channels), with an
    average-pooled 1×1 projection as the shortcut where the shape changes. ``branch`` is a module of
    its own so that fine-tuning's drop path can hook it (:mod:`nclip.finetune.layers`)."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        mid = c_out // EXPANSION
        pool = [nn.AvgPool2d(stride)] if stride > 1 else []
        self.branch = nn.Sequential(*_conv_bn_relu(c_in, mid, 1), *_conv_bn_relu(mid, mid, 3), *pool,
                                    nn.Conv2d(mid, c_out, 1, bias=False), nn.BatchNorm2d(c_out))
        self.shortcut = nn.Identity()
        if stride > 1 or c_in != c_out:
            self.shortcut = nn.Sequential(*pool, nn.Conv2d(c_in, c_out, 1, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, c_in, H, W] → [B, c_out, H/s, W/s]
        return F.relu(self.branch(x) + self.shortcut(x))


class AttentionPool(nn.Module):
    """CLIP's attention pooling of a feature map [B, C, h, w] → [B, out_dim].

    Tokens: the map's mean, then its h·w positions, plus a position embedding [1 + h·w, C]. One
    query (the mean token's) attends over all 1 + h·w tokens with ``heads`` heads of C/heads
    channels; the heads' outputs, concatenated, are projected to ``out_dim``."""

    def __init__(self, positions: int, width: int, heads: int, out_dim: int):
        super().__init__()
        self.heads = heads
        self.position = nn.Parameter(torch.randn(positions + 1, width) / width**0.5)
        self.query, self.key, self.value = (nn.Linear(width, width) for _ in range(3))
        self.proj = nn.Linear(width, out_dim)
        for layer in (self.query, self.key, self.value, self.proj):
            nn.init.normal_(layer.weight, std=width**-0.5)

    def _qkv(self, fmap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, heads, 1, d], k and v [B, heads, 1 + h·w, d] with d = C / heads."""
        grid = fmap.flatten(2).transpose(1, 2)  # [B, h*w, C]
        if grid.shape[1] + 1 != len(self.position):
            raise NclipError(f"clip_resnet image tower built for {len(self.position) - 1} positions got a "
                             f"{fmap.shape[-2]}x{fmap.shape[-1]} feature map ({grid.shape[1]} positions)")
        tokens = torch.cat([grid.mean(dim=1, keepdim=True), grid], dim=1) + self.position.to(grid.dtype)

        def split(x: torch.Tensor) -> torch.Tensor:  # [B, T, C] → [B, heads, T, C / heads]
            return x.unflatten(-1, (self.heads, -1)).transpose(1, 2)

        return split(self.query(tokens[:, :1])), split(self.key(tokens)), split(self.value(tokens))

    def forward(self, fmap: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(fmap)
        mixed = F.scaled_dot_product_attention(q, k, v)  # [B, heads, 1, d]
        return self.proj(mixed[:, :, 0].flatten(1))  # [B, out_dim]

    def weights(self, fmap: torch.Tensor) -> torch.Tensor:
        """The query's attention [B, heads, 1 + h·w] (softmax over the mean token, then the map's
        positions): the weights that make :meth:`forward`'s output."""
        q, k, _ = self._qkv(fmap)
        return torch.softmax((q @ k.transpose(-1, -2))[:, :, 0] * q.shape[-1] ** -0.5, dim=-1)


class ClipResNetTower(nn.Module):
    """CLIP's modified ResNet (see the module docstring): pixels [B, 3, S, S] → [B, pool_dim]."""

    kind = "clip_resnet"
    feature = "the attention-pooled last stage (CLIP's modified ResNet)"
    saliency = "attention-pool query attention"

    def __init__(self, cfg: VisionConfig, image_size: int):
        super().__init__()
        w = cfg.embedding_size
        self.stem = nn.Sequential(*_conv_bn_relu(3, w // 2, 3, stride=2), *_conv_bn_relu(w // 2, w // 2, 3),
                                  *_conv_bn_relu(w // 2, w, 3), nn.AvgPool2d(2))
        stages, c_in = [], w
        for s, (depth, c_out) in enumerate(zip(cfg.depths, cfg.hidden_sizes)):
            blocks = [Bottleneck(c_in if i == 0 else c_out, c_out, stride=2 if s > 0 and i == 0 else 1)
                      for i in range(depth)]
            stages.append(nn.Sequential(*blocks))
            c_in = c_out
        # a ModuleList: FSDP shards its entries as units (nclip.train.launch), checkpointing runs them one by one
        self.stages = nn.ModuleList(stages)
        side = clip_resnet_grid(image_size, len(cfg.depths))
        if side < 1:
            raise NclipError(f"clip_resnet: images of {image_size} px leave no feature map after "
                             f"{len(cfg.depths)} stages")
        self.width = cfg.pool_dim or c_in
        self.pool = AttentionPool(side * side, c_in, cfg.heads, self.width)
        for m in self.modules():
            if isinstance(m, Bottleneck):  # γ = 0: each block starts as its shortcut (the released model's init)
                nn.init.zeros_(m.branch[-1].weight)
        self.grad_checkpointing = False
        pixel_stats.add(self, cfg.pixel_mean, cfg.pixel_std)  # a tower trained with other statistics sees its own

    def _body(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, 3, S, S] → the last stage's map [B, C, h, w]."""
        pixels = pixel_stats.apply(self, pixels)
        if not (self.grad_checkpointing and recompute.active(self)):
            x = self.stem(pixels)
            for stage in self.stages:
                x = stage(x)
            return x
        # Per stage, as ResNetTower: each stage entered through its own call (FSDP's hooks); the
        # pool (one query's attention) is small and stays as it is
        x = recompute.checkpoint_once(self.stem, pixels)
        for stage in self.stages:
            x = recompute.checkpoint_once(stage, x)
        return x

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, 3, S, S] normalised → attention-pooled feature [B, width]."""
        return self.pool(self._body(pixels))

    def enable_grad_checkpointing(self) -> None:
        self.grad_checkpointing = True

    @torch.no_grad()
    def attention_maps(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, heads, h, w]: each pooling head's attention from the query over the last map's
        positions, the weight it puts on its own (mean) token left out, as DINO leaves out [CLS]'s."""
        fmap = self._body(pixels)
        att = self.pool.weights(fmap)[:, :, 1:]  # [B, heads, h*w]
        return att.reshape(*att.shape[:2], *fmap.shape[-2:]).float().cpu()
