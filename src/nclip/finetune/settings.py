"""The fine-tuning config (:class:`FinetuneSettings`): typed, frozen, unknown keys are errors; a
bad value is one line (``finetune: fraction: ...``), as :mod:`nclip.eval.settings` does it.

Defaults follow the xCLIP paper's App. C (the BEiT recipe): layer-wise lr decay 0.65, weight
decay 0.05, drop path 0.1, [CLS] (pooled) features. Its four learning rates {3e-3 ... 6e-3} are
for ViT-B at batch 1024 over 100 epochs; for the CPU-sized towers here the sweep and the epochs
are scaled down (docs/finetune.md).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from nclip.defaults import DEVICES
from nclip.errors import NclipError

LAYER_DECAY = 0.65  # App. C
WEIGHT_DECAY = 0.05  # App. C
DROP_PATH = 0.1  # App. C
LRS = (3e-4, 1e-3, 3e-3)  # scaled-down sweep; the paper: {3e-3, 4e-3, 5e-3, 6e-3} at batch 1024
FINETUNE_KINDS = ("digits", "synthetic", "folder")  # datasets with single-label train and test splits


class FinetuneSettings(BaseModel):
    """The resolved fine-tuning config (written to results.json ``config``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dataset: str = "digits"
    # share of the training labels used (Tab. 6: 0.01, 0.1, 1); class-balanced, seeded, >= 1 per class
    fraction: float = Field(1.0, gt=0, le=1)
    # "cosine": backbone → CLIP image head → cosine classifier initialised with the prompt-ensembled
    # class-name embeddings and the learned logit scale (step 0 = zero-shot); "linear": pooled
    # backbone feature → a linear classifier (zero-initialised); "auto": cosine for a checkpoint with
    # a CLIP head when fraction < 1 (the paper's choice for few labels), else linear
    classifier: Literal["auto", "linear", "cosine"] = "auto"
    epochs: int = Field(10, ge=1)
    lrs: tuple[Annotated[float, Field(gt=0, allow_inf_nan=False)], ...] = Field(LRS, min_length=1)
    layer_decay: float = Field(LAYER_DECAY, gt=0, le=1)
    weight_decay: float = Field(WEIGHT_DECAY, ge=0)
    drop_path: float = Field(DROP_PATH, ge=0, lt=1)
    warmup_epochs: float = Field(1.0, ge=0)
    min_lr: float = Field(1e-6, ge=0)
    batch_size: int = Field(64, ge=1)
    # share of each class of the training split held out as the validation split that chooses the
    # learning rate and the epoch (never the test split)
    val_fraction: float = Field(0.2, gt=0, lt=1)
    test_samples: int = Field(1000, ge=10, description="synthetic test scenes")
    train_samples: int = Field(2000, ge=10, description="synthetic training scenes")
    seed: int = 0
    # WiSE-FT after fine-tuning: evaluate these mixes of the zero-shot start (0) and the fine-tuned
    # network (1) (nclip.finetune.wise; changes no training, so a resume may change it)
    wise: tuple[Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)], ...] = ()
    device: Literal[DEVICES] = "auto"  # type: ignore[valid-type]

    @field_validator("dataset")
    @classmethod
    def _dataset(cls, spec: str) -> str:
        from nclip.dataset_specs import parse_spec

        try:
            kind, arg = parse_spec(spec)
        except NclipError as e:
            raise ValueError(str(e)) from None
        if kind not in FINETUNE_KINDS:
            raise ValueError(f"cannot fine-tune on {spec!r}: use digits, synthetic or folder:DIR "
                             "(single-label train and test splits)")
        return spec if arg is None else f"{kind}:{arg}"

    def updated(self, **changes) -> "FinetuneSettings":
        return validated({**self.model_dump(), **changes})


def validated(fields: dict[str, Any]) -> FinetuneSettings:
    """:class:`FinetuneSettings` from ``fields``; a bad value is a one-line :class:`NclipError`."""
    try:
        return FinetuneSettings.model_validate(fields)
    except ValidationError as e:
        from nclip.config import describe_validation_error

        raise NclipError(describe_validation_error(e, "finetune")) from None
