"""The training section of the run configuration, ``train``: steps, batch, optimizer, precision,
strategy, checkpoints, reporting, and evaluation while training (its checks: :mod:`nclip.config.eval`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from nclip.config.eval import DEFAULT_EVAL_EVERY, DEFAULT_EVAL_SAMPLES, check_eval_datasets
from nclip.config.section import Section, require_package
from nclip.defaults import DEVICES


class TrainConfig(Section):
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
    device: Literal[DEVICES] = "auto"  # type: ignore[valid-type]
    log_every: int = Field(10, ge=1)
    checkpoint_every: int = Field(500, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    # torch intra-op threads: auto takes the cores of this process's affinity less its data workers and the
    # cores the load says are busy (nclip.train.threads); null: torch's default
    threads: Annotated[int, Field(ge=1)] | Literal["auto"] | None = Field("auto", description="torch intra-op threads")
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
            require_package(*need)
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

