"""The image tower's section of the run configuration, ``model.vision`` (re-exported by
:mod:`nclip.config`, part of the config layer), and the checks that need the image size.

Kept out of ``nclip/config.py`` so that it stays under the house limit of 500 lines as towers are
added. Same rules as every section: typed, unknown keys are errors, one-line ``ValueError``s.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

CONV_KINDS = ("resnet", "convnet", "clip_resnet")  # the towers built from depths and hidden_sizes
GROUPVIT_GROUP_TOKENS = (64, 8, 0)  # GroupViT's (Xu et al. 2022, Sec. 4.1): 64 groups, then 8
GROUPVIT_OUTPUT_GROUPS = (64, 8, 8)


class VisionConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # "vit": a CLIP vision transformer (patch_size, width, layers, heads, mlp_ratio);
    # "resnet": a transformers ResNetModel from config (depths, hidden_sizes, embedding_size;
    # ResNet-50 by default), feature = its globally pooled last stage;
    # "clip_resnet": CLIP's modified ResNet (Radford et al. 2021, Sec. 2.4): a 3-conv stem of
    # embedding_size/2, embedding_size/2, embedding_size channels, anti-aliased strides, attention
    # pooling with `heads` heads and output pool_dim (RN50: embedding_size 64, depths [3, 4, 6, 3],
    # hidden_sizes [256, 512, 1024, 2048], heads 32, pool_dim 1024); nclip.models.clip_resnet;
    # "convnet": a small conv net for small images (embedding_size, depths, hidden_sizes, heads of
    # its attention pooling), see nclip.models.towers.ConvNetTower;
    # "groupvit": GroupViT's grouping transformer (Xu et al. 2022; transformers' GroupViTVisionModel):
    # patch_size, width, heads, mlp_ratio, and per stage depths (layers), group_tokens and output_groups;
    # feature = the mean of the last stage's group tokens (nclip.models.groupvit_tower)
    kind: Literal["vit", "resnet", "convnet", "clip_resnet", "groupvit"] = "vit"
    patch_size: int = Field(8, ge=1)
    width: int = Field(128, ge=8)
    layers: int = Field(4, ge=1)
    heads: int = Field(4, ge=1)
    mlp_ratio: float = Field(4.0, gt=0)
    # resnet, clip_resnet: bottleneck blocks per stage; groupvit: transformer layers per stage (GroupViT's
    # (6, 3, 3) when a groupvit section leaves it out)
    depths: tuple[int, ...] = (3, 4, 6, 3)
    hidden_sizes: tuple[int, ...] = (256, 512, 1024, 2048)  # resnet, clip_resnet: output channels per stage
    embedding_size: int = Field(64, ge=8, description="resnet, clip_resnet: stem channels")
    # groupvit: the learned group tokens of each stage (0: a last stage without grouping) and the groups
    # each stage's grouping block outputs (GroupViT's 1-stage-per-grouping layout: (64, 8, 0), (64, 8, 8))
    group_tokens: tuple[int, ...] = GROUPVIT_GROUP_TOKENS
    output_groups: tuple[int, ...] = GROUPVIT_OUTPUT_GROUPS
    # clip_resnet: the attention pool's output projection (CLIP's RN50: 1024, its embedding
    # dimension); None: the last stage's width
    pool_dim: int | None = Field(None, ge=1)
    # vit: OpenAI CLIP's towers use quick_gelu, SigLIP's gelu_pytorch_tanh
    hidden_act: Literal["gelu", "quick_gelu", "gelu_pytorch_tanh"] = "gelu"
    # vit: "cls" the final-norm class token (CLIP); "map" SigLIP's ViT: no class token, no pre-norm, the
    # post-norm patch tokens pooled by a multi-head attention-pooling head (nclip.models.siglip_towers)
    pooling: Literal["cls", "map"] = "cls"
    # vit, clip_resnet: the mean/std the tower expects its pixels normalised with; None: CLIP's, the data layer's
    # own (a tower started from a model trained with other statistics re-normalises its input)
    pixel_mean: tuple[float, float, float] | None = None
    pixel_std: tuple[float, float, float] | None = None
    # vit: FLIP's patch dropout, the share of patch tokens each training image drops (eval keeps all;
    # nclip.models.patch_dropout); train.unmasked_steps trains the last steps with every patch
    patch_dropout: float = Field(0.0, ge=0, lt=1)
    # locked-image tuning (LiT): the tower frozen, run without gradients and in eval mode; or only its
    # last N layers (blocks; stages for the conv towers) trained (nclip.models.locking, docs/locking.md)
    lock: bool = False
    unlocked_layers: int | None = Field(None, ge=1)
    # resnet, convnet, clip_resnet: the tower's normalisation, "batch" as built, or one without batch
    # statistics ("group": GroupNorm, "frozen_batch": BatchNorm on its running statistics), with which
    # exact accumulation is exact in the tower too (nclip.models.tower_norm)
    norm: Literal["batch", "group", "frozen_batch"] = "batch"

    @model_validator(mode="before")
    @classmethod
    def _groupvit_depths(cls, data):
        """A groupvit section without depths gets GroupViT's (6, 3, 3), not the ResNet-50 default."""
        if isinstance(data, dict) and data.get("kind") == "groupvit" and "depths" not in data:
            data = {**data, "depths": (6, 3, 3)}
        return data

    @model_validator(mode="after")
    def _divisible(self):
        if self.norm != "batch" and self.kind not in CONV_KINDS:
            raise ValueError(f"norm {self.norm} needs a conv kind ({', '.join(CONV_KINDS)}; got {self.kind})")
        if self.patch_dropout and self.kind != "vit":
            raise ValueError(f"patch_dropout needs kind vit (got {self.kind})")
        if self.pooling != "cls" and (self.kind != "vit" or self.patch_dropout):
            raise ValueError(f"pooling {self.pooling} needs kind vit without patch_dropout (got {self.kind})")
        if self.pool_dim is not None and self.kind != "clip_resnet":
            raise ValueError(f"pool_dim needs kind clip_resnet (got {self.kind})")
        if self.kind in CONV_KINDS and (len(self.depths) != len(self.hidden_sizes) or not self.depths
                                        or min(self.depths) < 1):
            raise ValueError(f"{self.kind} depths {self.depths} and hidden_sizes {self.hidden_sizes} must be "
                             "non-empty, positive and of the same length")
        if self.kind == "groupvit":
            _groupvit_stages(self)
        elif (self.group_tokens, self.output_groups) != (GROUPVIT_GROUP_TOKENS, GROUPVIT_OUTPUT_GROUPS):
            raise ValueError(f"group_tokens and output_groups need kind groupvit (got {self.kind})")
        if self.kind in ("vit", "groupvit") and self.width % self.heads:
            raise ValueError(f"vision width {self.width} is not divisible by heads {self.heads}")
        if (self.pixel_mean is None) != (self.pixel_std is None) or min(self.pixel_std or (1,)) <= 0:
            raise ValueError("pixel_mean and pixel_std go together, with every std > 0")
        if self.pixel_mean is not None and self.kind not in ("vit", "clip_resnet"):
            raise ValueError(f"pixel_mean/pixel_std need kind vit or clip_resnet (got {self.kind})")
        if self.kind in ("convnet", "clip_resnet") and self.hidden_sizes[-1] % self.heads:
            raise ValueError(f"{self.kind} last width {self.hidden_sizes[-1]} is not divisible by heads {self.heads}")
        if self.kind == "clip_resnet":
            _clip_resnet_widths(self)
        layers = self.layers if self.kind == "vit" else len(self.depths)  # groupvit: its stages
        lock_problem(self.lock, self.unlocked_layers, layers, "vision")
        return self


def lock_problem(lock: bool, unlocked_layers: int | None, layers: int | None, tower: str) -> None:
    """A tower's ``lock``/``unlocked_layers`` pair (model.vision, model.text) checked against its
    ``layers`` (None: known once the tower is built); raises a one-line ValueError."""
    if lock and unlocked_layers is not None:
        raise ValueError(f"model.{tower}: give lock or unlocked_layers, not both")
    if unlocked_layers is not None and layers is not None and unlocked_layers > layers:
        raise ValueError(f"model.{tower}.unlocked_layers {unlocked_layers} exceeds the tower's {layers} layers")


def _groupvit_stages(cfg: VisionConfig) -> None:
    """GroupViT's stage layout: one entry per stage in depths, group_tokens and output_groups; every
    stage but the last groups (a stage's group tokens are projected from the previous stage's
    groups), and a last stage without group tokens keeps the groups it is given."""
    stages = len(cfg.depths)
    if not (stages == len(cfg.group_tokens) == len(cfg.output_groups)) or min(cfg.depths, default=0) < 1:
        raise ValueError(f"groupvit depths {cfg.depths}, group_tokens {cfg.group_tokens} and output_groups "
                         f"{cfg.output_groups} need one entry per stage, depths positive")
    if min(cfg.group_tokens[:-1] or (1,)) < 1 or cfg.group_tokens[-1] < 0 or min(cfg.output_groups) < 1:
        raise ValueError(f"groupvit group_tokens {cfg.group_tokens} must be positive (the last may be 0) and "
                         f"output_groups {cfg.output_groups} positive")
    if cfg.group_tokens[-1] == 0 and (stages < 2 or cfg.output_groups[-1] != cfg.output_groups[-2]):
        raise ValueError(f"groupvit: a last stage without group tokens follows a grouping stage and keeps its "
                         f"groups (output_groups {cfg.output_groups})")


def _clip_resnet_widths(cfg: VisionConfig) -> None:
    if cfg.embedding_size % 2:
        raise ValueError(f"clip_resnet embedding_size {cfg.embedding_size} must be even (the stem's first two "
                         "convolutions have half as many channels)")
    if any(size % 4 for size in cfg.hidden_sizes):
        raise ValueError(f"clip_resnet hidden_sizes {cfg.hidden_sizes} must be multiples of 4 (a bottleneck's "
                         "output has 4x the channels of its 3x3 convolution)")


def clip_resnet_grid(image_size: int, stages: int) -> int:
    """The side of clip_resnet's last feature map for square images of ``image_size`` px: the
    stride-2 first convolution (padding 1: ⌈s/2⌉), the stem's 2×2 average pool, then a 2×2 average
    pool in each stage after the first (⌊s/2⌋ each). 224 px, 4 stages: 112, 56, 56, 28, 14, 7."""
    side = -(-image_size // 2) // 2
    for _ in range(stages - 1):
        side //= 2
    return side


def image_size_problem(vision: VisionConfig, image_size: int) -> str | None:
    """Why images of ``image_size`` px do not fit the tower (one line, naming both keys), or None."""
    # SigLIP's ViT ("map") drops the last image_size % patch_size rows and columns, as its patch convolution
    # does (so400m-patch14-384: 27² patches of 384 px); CLIP's position embeddings want the exact grid
    if vision.kind in ("vit", "groupvit") and vision.pooling == "cls" and image_size % vision.patch_size:
        return f"data.image_size {image_size} is not divisible by model.vision.patch_size {vision.patch_size}"
    stages = len(vision.depths)
    if vision.kind == "convnet" and -(-image_size // 2) < 2 ** (stages - 1):
        # a stride-2 stem, then a 2×2 max pool before every later stage: the map must keep a pixel
        return (f"data.image_size {image_size} is too small for a convnet of {stages} stages "
                f"(at least {2 ** stages - 1} px)")
    if vision.kind == "clip_resnet" and clip_resnet_grid(image_size, stages) < 1:
        return (f"data.image_size {image_size} is too small for a clip_resnet of {stages} stages "
                f"(at least {2 ** (stages + 1) - 1} px)")
    return None
