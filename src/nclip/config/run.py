"""The whole run configuration, :class:`RunConfig`: its sections (:mod:`nclip.config.data`,
:mod:`~nclip.config.model`, :mod:`~nclip.config.train`, :mod:`~nclip.config.eval`) and the objective,
a union discriminated by ``name`` built from the objective registry so that each objective validates
its own keys; the checks across sections; loading a preset, applying ``--set`` overrides,
validating, and describing a validation error in one line.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Annotated, Any, Callable, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from nclip import plugin_consent
from nclip.config.data import DataConfig
from nclip.config.eval import EvalConfig
from nclip.config.model import ModelConfig, image_size_problem
from nclip.config.section import Section
from nclip.config.train import TrainConfig
from nclip.config_files import apply_overrides, preset_text, synthetic_settings_give_way
from nclip.errors import NclipError
from nclip.jsonio import parse_yaml, read_text


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


class RunConfig(Section):
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
        if self.data.caption_choice == "all" and not plan.several_captions:
            raise ValueError(f"data.caption_choice all makes every caption of an image a positive, and objective "
                             f"{self.objective.name!r} takes one caption per image; use caption_choice random or "
                             "first, or an objective that takes several (clip)")
        negatives = self.data.hard_negative_key is not None or self.data.hard_negatives is not None
        if negatives and not plan.hard_negatives:
            key = "hard_negative_key" if self.data.hard_negative_key is not None else "hard_negatives"
            raise ValueError(f"data.{key}: objective {self.objective.name!r} takes no hard negative captions; use an "
                             "objective that does (clip, siglip)")
        heads = plan.heads
        if self.model.nclip_shared_layers and not {"clip", "nclip"} <= heads:
            raise ValueError(f"model.nclip_shared_layers {self.model.nclip_shared_layers}: objective "
                             f"{self.objective.name!r} has no CLIP and nCLIP heads to share layers (xclip has)")
        if self.eval.probe_features is not None and (problem := plan.probe_problem(self.eval.probe_features)):
            raise ValueError(f"eval.probe_features {self.eval.probe_features}: {problem}")
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
        text = preset_text(name_or_path)
    raw = parse_yaml(name_or_path, text)
    if not isinstance(raw, dict):  # an empty file too: never the library defaults by accident
        raise NclipError(f"{name_or_path}: {'the file is empty' if raw is None else 'the top level must be a mapping'}")
    return raw


@functools.cache
def _sections() -> type[BaseModel]:
    """RunConfig less its objective: checked first, before the objective's union imports torch."""
    fields = {k: (f.annotation, f) for k, f in RunConfig.model_fields.items() if k != "objective"}
    return create_model("RunConfig", __base__=Section, **fields)


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


def resolve(preset: str, overrides: list[str] | None = None, trust_plugin: bool = True) -> RunConfig:
    """The config of a preset or YAML file with ``--set`` overrides, validated. Both are the user's
    own, so a plugin they name may come from the working directory (nclip.plugin_consent);
    ``trust_plugin=False`` for a config that came with a run (``nclip train --resume`` without --preset)."""
    raw = apply_overrides(load_preset(preset), overrides or [])
    with plugin_consent.consent(trust_plugin):
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
