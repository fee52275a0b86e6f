"""Image and text towers built from ``transformers`` configs (no weights are downloaded).

The image tower is a CLIP vision transformer (feature = final-norm [CLS] token), a ResNet, CLIP's
modified ResNet (:mod:`nclip.models.clip_resnet`), GroupViT (:mod:`nclip.models.groupvit_tower`) or a
small conv net with attention pooling. The
text tower is either a CLIP text transformer from scratch (causal, feature = final-norm [EOS], here
the WordPiece [SEP]) or a local pretrained encoder such as the bundled MiniLM (feature = its pooled
output, or the mean/[CLS] token). SigLIP's towers (``model.vision.pooling: map``, ``model.text.eos_pooling:
last``) are in :mod:`nclip.models.siglip_towers`.

Each image tower class says in ``feature`` what its feature is (the evaluation report quotes it)
and in ``saliency`` which attention over image positions its ``attention_maps`` returns -- or
None when it pools without attention, and has no ``attention_maps`` (mask probing is skipped).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    CLIPTextConfig,
    CLIPTextModel,
    CLIPVisionConfig,
    CLIPVisionModel,
    ResNetConfig,
    ResNetModel,
)

from nclip.config import ModelConfig, TextConfig, VisionConfig
from nclip.config.model import TEXT_KINDS, VISION_KINDS
from nclip.data.tokenization import bundled_model_dir
from nclip.errors import NclipError
from nclip.models import pixel_stats, recompute
from nclip.models.clip_resnet import ClipResNetTower
from nclip.models.groupvit_tower import GroupViTTower, groupvit_config
from nclip.models.patch_dropout import drop_patches
from nclip.models.siglip_towers import SiglipTextTower, SiglipVisionTower, siglip_text_config, siglip_vision_config
from nclip.models.tower_norm import set_tower_norm


def vision_config(cfg: VisionConfig, image_size: int) -> CLIPVisionConfig:
    return CLIPVisionConfig(
        hidden_size=cfg.width,
        intermediate_size=int(cfg.width * cfg.mlp_ratio),
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        image_size=image_size,
        patch_size=cfg.patch_size,
        hidden_act=cfg.hidden_act,
        attn_implementation="sdpa",
    )


ARGMAX_EOS_ID = 2  # transformers' CLIPTextModel switch to argmax pooling (see text_config)


def text_config(cfg: TextConfig, vocab_size: int, length: int, pad_id: int, cls_id: int, eos_id: int) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.width,
        intermediate_size=int(cfg.width * cfg.mlp_ratio),
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        max_position_embeddings=length,
        hidden_act=cfg.hidden_act,
        pad_token_id=pad_id,
        bos_token_id=cls_id,
        # CLIPTextModel pools the first position holding this id -- or, for the id 2 of configs
        # older than transformers PR #24773, the position of the largest id (OpenAI CLIP's pooling)
        eos_token_id=ARGMAX_EOS_ID if cfg.eos_pooling == "argmax" else eos_id,
        attn_implementation="sdpa",
    )


def _set_impl(module, impl: str) -> None:
    if hasattr(module, "set_attn_implementation"):
        module.set_attn_implementation(impl)
    else:  # older transformers: the attention classes read the config at call time
        module.config._attn_implementation = impl


@contextmanager
def eager_attention(module):
    """Run ``module`` (a transformers model) with eager attention inside the block, then restore.

    The fused SDPA kernel never materialises the attention weights (transformers then returns an
    empty tuple for ``output_attentions``)."""
    before = getattr(module.config, "_attn_implementation", None) or "eager"
    if before != "eager":
        _set_impl(module, "eager")
    try:
        yield module
    finally:
        if before != "eager":
            _set_impl(module, before)


@torch.no_grad()
def cls_attention(vision_model, pixels: torch.Tensor) -> torch.Tensor:
    """Last-layer attention of [CLS] over the patches of a transformers CLIPVisionModel:
    [B, heads, h, w] (rows sum to < 1: the weight [CLS] puts on itself is left out, as in DINO)."""
    with eager_attention(vision_model):
        out = vision_model(pixel_values=pixels, output_attentions=True)
    if not out.attentions:
        raise NclipError("the vision tower returned no attention weights (output_attentions)")
    att = out.attentions[-1][:, :, 0, 1:]  # [B, heads, h*w]
    side = int(round(att.shape[-1] ** 0.5))
    if side * side != att.shape[-1]:
        raise NclipError(f"cannot arrange {att.shape[-1]} patch tokens on a square grid")
    return att.reshape(*att.shape[:2], side, side).float().cpu()


class VisionTower(nn.Module):
    kind = "vit"
    feature = "the final-norm [CLS] token"
    saliency = "[CLS] attention"

    def __init__(self, config: CLIPVisionConfig, mean=None, std=None, patch_dropout: float = 0.0):
        super().__init__()
        self.model = CLIPVisionModel(config)
        self.width = config.hidden_size
        # FLIP's rate (nclip.models.patch_dropout), a plain attribute the trainer changes between
        # steps (train.unmasked_steps); not in the state dict
        self.patch_dropout = patch_dropout
        pixel_stats.add(self, mean, std)  # a tower trained with other statistics sees its own

    def _pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """The data layer normalises with CLIP's mean/std; a tower trained with others sees its own."""
        return pixel_stats.apply(self, pixels)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, 3, H, W] normalised → final-norm [CLS] feature [B, width]; while training with
        ``patch_dropout`` p > 0 the encoder sees [CLS] and round((1 − p)·N) random patches."""
        if not (self.training and self.patch_dropout > 0):
            return self.model(pixel_values=self._pixels(pixels)).pooler_output
        return self._encode(self._pixels(pixels), self.patch_dropout)

    def _encode(self, pixels: torch.Tensor, p: float) -> torch.Tensor:
        """transformers' CLIPVisionModel.forward, step for step, with patch dropout between the
        embeddings and the pre-norm (at p = 0 bitwise the model's pooler_output; tested)."""
        vit = getattr(self.model, "vision_model", self.model)  # transformers < 5 nests the transformer
        tokens = drop_patches(vit.embeddings(pixels), p)  # [B, 1 + K, width]
        hidden = vit.encoder(inputs_embeds=vit.pre_layrnorm(tokens)).last_hidden_state
        return vit.post_layernorm(hidden[:, 0])

    def attention_maps(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, heads, h, w]: the last layer's [CLS] attention over the patch grid."""
        return cls_attention(self.model, self._pixels(pixels))

    def enable_grad_checkpointing(self) -> None:
        recompute.enable_hf(self.model)  # each encoder layer


def resnet_config(cfg: VisionConfig) -> ResNetConfig:
    return ResNetConfig(
        num_channels=3,
        embedding_size=cfg.embedding_size,
        hidden_sizes=list(cfg.hidden_sizes),
        depths=list(cfg.depths),
        layer_type="bottleneck",
        hidden_act="relu",
        downsample_in_first_stage=False,
    )


class ResNetTower(nn.Module):
    """A ``transformers`` ResNetModel built from config (He et al.'s standard ResNet, as CMSF's
    ResNet-50; CLIP's modified one, as ProtoCLIP's, is ``kind: clip_resnet``). Feature = the global
    average pool of the last stage."""

    kind = "resnet"
    feature = "the global average pool of the last stage"
    saliency = None  # average pooling weighs every position alike: no attention to probe

    def __init__(self, config: ResNetConfig):
        super().__init__()
        self.model = ResNetModel(config)
        self.width = config.hidden_sizes[-1]
        self.grad_checkpointing = False

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, 3, H, W] normalised → pooled feature [B, width]."""
        if not (self.grad_checkpointing and recompute.active(self)):
            return self.model(pixel_values=pixels).pooler_output.flatten(1)
        # transformers' ResNet has no checkpointing of its own: ResNetModel.forward's path, with the
        # stem and each stage checkpointed. Per stage, not per residual block: the stages are the
        # entries of a ModuleList, which train.strategy fsdp shards as units (nclip.train.launch),
        # and a stage must be entered through its own call for FSDP's hooks to gather its weights
        x = recompute.checkpoint_once(self.model.embedder, pixels)
        for stage in self.model.encoder.stages:
            x = recompute.checkpoint_once(stage, x)
        return self.model.pooler(x).flatten(1)

    def enable_grad_checkpointing(self) -> None:
        self.grad_checkpointing = True


class ConvNetTower(nn.Module):
    """A small VGG-style conv net for small images, with CLIP's attention pooling.

    Library ResNets downsample 4× in their stem (7×7 stride-2 conv, then a stride-2 max pool), which
    at 64 px shrinks a small shape to a blob of 3 pixels. Here a stride-2 3×3 conv is the only
    downsampling before the first stage, and each later stage halves the map with a 2×2 max pool.
    Measured on 64-px synthetic scenes, supervised main-shape top-1 after 300 steps × 128: 0.48 for
    a net of this layout (widths 32–256, global max pool), 0.24 for a transformers ResNet with one
    basic block per stage at widths 32–256, 0.09 for the 3-layer ViT with patch 8 (0.13 after 600).

    The feature is the output of one multi-head attention whose query is the mean of the last map
    plus a learned position embedding, as in CLIP's ResNet (Radford et al. 2021, Sec. 2.4): unlike
    average pooling it keeps where things are, which captions about positions need.
    """

    kind = "convnet"
    feature = "the attention-pooled last feature map"
    saliency = "attention-pool query attention"

    def __init__(self, cfg: VisionConfig, image_size: int):
        super().__init__()

        def conv(c_in: int, c_out: int, stride: int = 1) -> list[nn.Module]:
            return [nn.Conv2d(c_in, c_out, 3, stride, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.GELU()]

        layers = conv(3, cfg.embedding_size, stride=2)
        c_in = cfg.embedding_size
        for stage, (depth, c_out) in enumerate(zip(cfg.depths, cfg.hidden_sizes)):
            if stage > 0:
                layers.append(nn.MaxPool2d(2))
            for _ in range(depth):
                layers += conv(c_in, c_out)
                c_in = c_out
        self.body = nn.Sequential(*layers)
        # the checkpointed units: each conv → BN → GELU, a max pool going with the block after it
        ends = [i + 1 for i, layer in enumerate(layers) if isinstance(layer, nn.GELU)]
        self._blocks = tuple(zip([0] + ends[:-1], ends))
        self.grad_checkpointing = False
        side = -(-image_size // 2) // 2 ** (len(cfg.depths) - 1)
        self.width = c_in
        self.position = nn.Parameter(torch.randn(side * side + 1, c_in) / c_in**0.5)
        self.pool = nn.MultiheadAttention(c_in, cfg.heads, batch_first=True)
        self.norm = nn.LayerNorm(c_in)

    def _tokens(self, pixels: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """pixels → ([B, 1 + h*w, C]: the query token (mean of the map) then the map's positions,
        position embeddings added; (h, w))."""
        fmap = self._body(pixels)  # [B, C, h, w]
        grid = fmap.flatten(2).transpose(1, 2)  # [B, h*w, C]
        if grid.shape[1] + 1 != len(self.position):
            raise NclipError(f"convnet image tower built for {len(self.position) - 1} positions got images of "
                             f"{pixels.shape[-2]}x{pixels.shape[-1]} px ({grid.shape[1]} positions)")
        return torch.cat([grid.mean(dim=1, keepdim=True), grid], dim=1) + self.position, fmap.shape[-2:]

    def _body(self, pixels: torch.Tensor) -> torch.Tensor:
        if not (self.grad_checkpointing and recompute.active(self)):
            return self.body(pixels)
        # Per conv block: only each block's input is kept, and the backward recomputes one block at
        # a time. A stage (several blocks) would keep fewer inputs but hold all of a stage's
        # activations during its recomputation; at the presets' 1-3 blocks per stage they barely
        # differ. The attention pool and the norm are small (one token's query) and stay as they are.
        x = pixels
        for start, end in self._blocks:
            x = recompute.checkpoint_once(self.body[start:end], x)
        return x

    def enable_grad_checkpointing(self) -> None:
        self.grad_checkpointing = True

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, 3, H, W] normalised → attention-pooled feature [B, width]."""
        tokens, _ = self._tokens(pixels)
        pooled, _ = self.pool(tokens[:, :1], tokens, tokens, need_weights=False)
        return self.norm(pooled[:, 0])

    @torch.no_grad()
    def attention_maps(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, heads, h, w]: each pooling head's attention from the query over the last map's
        positions -- the weights that make the feature, as [CLS] attention does in a ViT (the
        weight the query puts on its own token is left out, as DINO leaves out [CLS])."""
        tokens, (h, w) = self._tokens(pixels)
        _, weights = self.pool(tokens[:, :1], tokens, tokens, need_weights=True, average_attn_weights=False)
        att = weights[:, :, 0, 1:]  # [B, heads, h*w]
        return att.reshape(*att.shape[:2], h, w).float().cpu()


# every kind of nclip.config.model.VISION_KINDS (checked below): its class (which says what its feature
# is and which attention it can show) and how it is built from the config and the image size
_VISION_KINDS: dict[str, tuple[type, Callable[[VisionConfig, int], nn.Module]]] = {
    "vit": (VisionTower, lambda cfg, size: VisionTower(vision_config(cfg, size), cfg.pixel_mean, cfg.pixel_std,
                                                       cfg.patch_dropout)),
    "resnet": (ResNetTower, lambda cfg, size: set_tower_norm(ResNetTower(resnet_config(cfg)), cfg.norm)),
    "convnet": (ConvNetTower, lambda cfg, size: set_tower_norm(ConvNetTower(cfg, size), cfg.norm)),
    "clip_resnet": (ClipResNetTower, lambda cfg, size: set_tower_norm(ClipResNetTower(cfg, size), cfg.norm)),
    "groupvit": (GroupViTTower, lambda cfg, size: GroupViTTower(groupvit_config(cfg, size), cfg.drop_path_rate)),
}
if _VISION_KINDS.keys() != VISION_KINDS.keys():  # a kind added to the config needs its tower here
    raise ImportError(f"nclip.models.towers builds {sorted(_VISION_KINDS)}, model.vision.kind has "
                      f"{sorted(VISION_KINDS)}")
VISION_TOWERS = {kind: cls for kind, (cls, _) in _VISION_KINDS.items()}


def _siglip_vit(cfg: VisionConfig) -> bool:
    """SigLIP's ViT: kind vit with its attention-pooling head (``pooling: map``)."""
    return cfg.kind == "vit" and cfg.pooling == "map"


def vision_tower_class(cfg: VisionConfig) -> type:
    """The class :func:`build_vision_tower` builds for ``cfg`` (its ``feature`` and ``saliency``)."""
    return SiglipVisionTower if _siglip_vit(cfg) else VISION_TOWERS[cfg.kind]


def build_vision_tower(cfg: VisionConfig, image_size: int) -> nn.Module:
    if _siglip_vit(cfg):
        return SiglipVisionTower(siglip_vision_config(cfg, image_size), cfg.pixel_mean, cfg.pixel_std)
    return _VISION_KINDS[cfg.kind][1](cfg, image_size)


class ClipTextTower(nn.Module):
    def __init__(self, config: CLIPTextConfig):
        super().__init__()
        self.model = CLIPTextModel(config)
        self.width = config.hidden_size

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids, mask [B, L] → final-norm [EOS] feature [B, width]. ``mask`` is accepted for the
        towers' common signature and not used (why: below).

        The tower is causal and pools the first end-of-text token, or the largest id (OpenAI CLIP's
        end-of-text, which is also its padding: argmax picks the first). Padding only follows the
        pooled position and causal attention never lets a position see later ones, so a padding
        mask cannot change the feature. Passing one costs a host sync per forward (transformers
        inspects the mask on the host to decide whether SDPA may skip it; 3-7 ms/step measured on
        an H100); OpenCLIP passes none either."""
        return self.model(input_ids=ids).pooler_output

    def enable_grad_checkpointing(self) -> None:
        recompute.enable_hf(self.model)  # each encoder layer


class PretrainedTextTower(nn.Module):
    """Any local ``transformers`` encoder directory (BERT-style), e.g. the bundled MiniLM."""

    def __init__(self, path: str, pooling: str, pretrained: bool = True):
        super().__init__()
        try:
            config = AutoConfig.from_pretrained(path, local_files_only=True)
            self.model = (
                AutoModel.from_pretrained(path, local_files_only=True)
                if pretrained
                else AutoModel.from_config(config)
            )
        except (OSError, ValueError) as e:
            raise NclipError(f"cannot load a text encoder from {path}: {str(e).splitlines()[0]}") from None
        self.pooling = pooling
        self.width = self.model.config.hidden_size

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=self._attention_mask(mask))
        if self.pooling == "pooler" and getattr(out, "pooler_output", None) is not None:
            return out.pooler_output
        if self.pooling == "mean":
            m = mask.unsqueeze(-1).to(out.last_hidden_state.dtype)  # [B, L, 1]
            return (out.last_hidden_state * m).sum(1) / m.sum(1).clamp_min(1)
        return out.last_hidden_state[:, 0]

    def _attention_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """The [B, L] padding mask as the 4-d mask [B, 1, 1, L] transformers would build from it for
        the model's attention (SDPA: bool, True = attend; eager: additive, 0 or the dtype's min).

        Given the 2-d mask, transformers' ``create_bidirectional_mask`` reads ``mask.all()`` on the
        host at every forward (to hand SDPA no mask when nothing is padded): a host wait per step on
        a GPU. A prepared 4-d mask it takes as it is. Captions are padded to the text length, so
        the mask it would drop is rarely all ones; where it is, SDPA with an all-true mask gives
        the unmasked result up to float rounding. Encoders whose modelling code does not take a
        prepared mask (a decoder, an older transformers, FlashAttention or flex kernels) get the
        2-d mask as before."""
        impl = getattr(self.model.config, "_attn_implementation", None)
        modelling = sys.modules.get(type(self.model).__module__)
        if (impl not in ("sdpa", "eager") or getattr(self.model.config, "is_decoder", False)
                or not hasattr(modelling, "create_bidirectional_mask")):
            return mask
        keep = mask.bool()[:, None, None, :]  # [B, 1, 1, L]: every query sees the unpadded keys
        if impl == "sdpa":
            return keep
        dtype = self.model.dtype  # eager adds the mask to its scores, in the embeddings' dtype
        return torch.zeros(keep.shape, dtype=dtype, device=mask.device).masked_fill_(~keep, torch.finfo(dtype).min)

    def enable_grad_checkpointing(self) -> None:
        recompute.enable_hf(self.model)  # each encoder layer


def _pretrained_text_tower(cfg: ModelConfig, tokenizer, length: int, pretrained: bool) -> nn.Module:
    return PretrainedTextTower(cfg.text.path or str(bundled_model_dir()), cfg.text.pooling, pretrained)


def _transformer_text_tower(cfg: ModelConfig, tokenizer, length: int, pretrained: bool) -> nn.Module:
    vocab = cfg.text.vocab_size or tokenizer.vocab_size
    if vocab < tokenizer.vocab_size:
        raise NclipError(f"model.text.vocab_size {vocab} is smaller than the tokenizer's vocabulary "
                         f"({tokenizer.vocab_size} tokens)")
    if cfg.text.eos_pooling == "last":  # SigLIP's text transformer
        return SiglipTextTower(siglip_text_config(cfg.text, vocab, length, tokenizer.pad_id, tokenizer.eos_id))
    return ClipTextTower(
        text_config(cfg.text, vocab, length, tokenizer.pad_id, tokenizer.cls_id, tokenizer.eos_id)
    )


# every kind of nclip.config.model.TEXT_KINDS (checked below) and how it is built
_TEXT_KINDS = {"transformer": _transformer_text_tower, "pretrained": _pretrained_text_tower}
if set(_TEXT_KINDS) != set(TEXT_KINDS):  # a kind added to the config needs its tower here
    raise ImportError(f"nclip.models.towers builds {sorted(_TEXT_KINDS)}, model.text.kind has {sorted(TEXT_KINDS)}")


def build_text_tower(cfg: ModelConfig, tokenizer, length: int, pretrained: bool = True) -> nn.Module:
    """The text tower of ``cfg.text.kind``; ``pretrained``: a pretrained encoder's weights loaded
    (False: its architecture only, for weights loaded next)."""
    return _TEXT_KINDS[cfg.text.kind](cfg, tokenizer, length, pretrained)
