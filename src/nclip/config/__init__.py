"""Typed, validated run configuration: YAML presets plus ``--set key=value`` overrides.

Every section is a pydantic model with ``extra="forbid"``, so a typo is an error, and with ranges
on every number, so a nonsensical value is an error; both surface as one line through
:class:`nclip.errors.NclipError`. One module per section (:mod:`~nclip.config.data`,
:mod:`~nclip.config.model`, :mod:`~nclip.config.train`, :mod:`~nclip.config.eval`); the whole run
and the objective section, a union discriminated by ``name`` built from the objective registry, in
:mod:`~nclip.config.run`. Importing the package loads no torch: the objectives' configs are unioned
on first use.
"""

from nclip.config.data import AugmentConfig, DataConfig, ShardSource, TaggingConfig
from nclip.config.eval import DEFAULT_EVAL_EVERY, DEFAULT_EVAL_SAMPLES, EvalConfig
from nclip.config.model import ModelConfig, TextConfig, VisionConfig, clip_resnet_grid, image_size_problem
from nclip.config.run import RunConfig, describe_validation_error, load_preset, resolve, to_yaml, validate
from nclip.config.train import TrainConfig
from nclip.config_files import apply_overrides, preset_names

__all__ = [
    "AugmentConfig", "DataConfig", "ShardSource", "TaggingConfig", "EvalConfig", "ModelConfig", "TextConfig",
    "VisionConfig", "TrainConfig", "RunConfig", "DEFAULT_EVAL_EVERY", "DEFAULT_EVAL_SAMPLES",
    "clip_resnet_grid", "image_size_problem", "describe_validation_error", "load_preset", "resolve", "to_yaml",
    "validate", "apply_overrides", "preset_names",
]
