"""LoRA on the towers through peft, ``model.lora: {rank, alpha, dropout, targets}`` (docs/transfer.md).

peft's ``inject_adapter_in_model`` wraps each targeted ``nn.Linear`` of a tower in its LoRA layer
(W x + (alpha / rank) · B A dropout(x), B zero at the start) and freezes everything else in the
tower; the heads and the logit scale are not touched and train whole. The module tree keeps peft's
names: a wrapped layer's weight is ``<layer>.base_layer.weight`` and its factors
``<layer>.lora_A.default.weight`` / ``lora_B``, so a LoRA run's training checkpoints (``step_N``) hold
the unmerged model and resume into the same tree.

Which towers: every tower that is not locked whole (``model.vision.lock`` / ``model.text.lock``
keep a tower locked, without an adapter) and that the model runs (an image-only objective's text
tower is frozen anyway). Which layers: :data:`DEFAULT_TARGETS` per tower kind, the attention and
MLP projections, or ``model.lora.targets``: patterns matched against a layer's name or any dotted
tail of it (``q_proj``, ``mlp.fc*``). Only plain linear layers qualify: a projection inside an
``nn.MultiheadAttention`` (SigLIP's pooling head, the conv net's pool) is read by weight, not
called, so an adapter there would change nothing. A tower's BatchNorm layers (the modified ResNet's)
are held in eval mode, frozen statistics and all, as a locked tower's are.

What a run saves (:func:`merged_for_saving`, called by :func:`nclip.models.io.save_model`):
``model.safetensors`` holds the MERGED model, each wrapped layer's weight W + (alpha / rank) · B A
as peft's ``merge`` computes it (``get_delta_weight``), under the plain names, and ``config.json``
its config without ``model.lora``; so evaluation, ``nclip.load``, ``nclip export`` (every format),
``nclip merge`` and ``model.init`` read it as any other model. Beside it, in peft's format,
``adapter_config.json`` (peft's ``LoraConfig``, its targets named from the dual encoder) and
``adapter_model.safetensors``: the factors (peft's saved names, ``<layer>.lora_A.weight``) and
everything outside the towers (the heads, the logit scale), which is all the run changed:
:func:`apply_adapter` on the model it started from (``model.init``) gives the run's model again.

peft is imported only where a model has LoRA (``pip install 'nclip[lora]'``).
"""

from __future__ import annotations

import fnmatch
import json
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from nclip.config.model import TEXT_KINDS, VISION_KINDS
from nclip.errors import NclipError
from nclip.models.locking import hold_frozen_batchnorm

ADAPTER_NAME = "default"  # peft's name of a model's one adapter (in the module tree, not in saved files)
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft's file names
ADAPTER_CONFIG = "adapter_config.json"
TOWERS = ("vision", "text")
_TRANSFORMER = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")  # CLIP, SigLIP, GroupViT
# the default targets per tower kind (model.vision.kind, model.text.kind): attention and MLP projections;
# () a tower with no linear layer LoRA can adapt (refused unless it is locked)
DEFAULT_TARGETS = {
    "vit": _TRANSFORMER,  # SigLIP's pooling head too: its MLP (its attention is an nn.MultiheadAttention)
    "groupvit": _TRANSFORMER,  # the grouping blocks' attention and MLPs too
    "clip_resnet": ("pool.query", "pool.key", "pool.value", "pool.proj"),  # the attention pool; the rest is conv
    "resnet": (),
    "convnet": (),  # its pool is an nn.MultiheadAttention
    "transformer": _TRANSFORMER,
    "pretrained": ("query", "key", "value", "output.dense", "intermediate.dense"),  # BERT-style (MiniLM)
}
if set(DEFAULT_TARGETS) != set(VISION_KINDS) | set(TEXT_KINDS):  # a tower kind added needs its targets here
    raise ImportError(f"nclip.models.lora has targets for {sorted(DEFAULT_TARGETS)}, the towers are "
                      f"{sorted(set(VISION_KINDS) | set(TEXT_KINDS))}")
_WORDS = {"vision": "image", "text": "text"}


def adapt_towers(model: nn.Module, cfg) -> None:
    """Inject ``cfg.model.lora`` into ``model``'s (a DualEncoder's) towers, their base weights frozen;
    a one-line :class:`NclipError` where it cannot apply. Call once the heads are built."""
    lora = cfg.model.lora
    copies = sorted(set(model.towers()) - set(TOWERS))
    if copies:  # CMSF's momentum target: a copy of the image tower, updated from its weights one by one
        raise NclipError(f"model.lora: objective {cfg.objective.name!r} keeps a copy of the image tower "
                         f"({', '.join(copies)}) that follows its weights; LoRA cannot adapt one without the other")
    towers = {name: getattr(model, name) for name in adapted_towers(cfg, model.uses_text)}
    if not towers:
        raise NclipError("model.lora: no tower to adapt (the image tower is locked and the objective runs no text "
                         "tower)")
    for pattern in lora.targets or ():
        if not any(_matches(pattern, n) for tower in towers.values() for n in _linear_layers(tower)):
            raise NclipError(f"model.lora.targets: {pattern!r} matches no linear layer of the "
                             f"{' or '.join(_WORDS[n] for n in towers)} tower ({_examples(towers)})")
    chosen = {name: _targets(name, tower, _kind(cfg, name), lora.targets) for name, tower in towers.items()}
    for name, tower in towers.items():
        _check_rank(lora.rank, name, tower, chosen[name])
    import peft

    for name, tower in towers.items():
        config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                 target_modules=list(chosen[name]))
        peft.inject_adapter_in_model(config, tower, adapter_name=ADAPTER_NAME)  # the rest of the tower frozen
        hold_frozen_batchnorm(tower)
    model.lora_targets = {name: chosen[name] for name in towers}


def describe(model: nn.Module, cfg) -> str:
    """The start-up block's line: the adapter's settings, where it is, and what it trains."""
    lora = cfg.model.lora
    where = " + ".join(f"{len(names)} {_WORDS[t]}" for t, names in model.lora_targets.items())
    adapted = [getattr(model, t) for t in model.lora_targets]
    trained = sum(p.numel() for tower in adapted for p in tower.parameters() if p.requires_grad)
    frozen = sum(p.numel() for tower in adapted for p in tower.parameters() if not p.requires_grad)
    return (f"rank {lora.rank}, alpha {lora.alpha:g}, dropout {lora.dropout:g} on {where} layers (peft): "
            f"{trained / 1e6:.3f}M trained params, the towers' {frozen / 1e6:.2f}M others frozen")


def adapted_towers(cfg, uses_text: bool = True) -> list[str]:
    """The towers ``model.lora`` adapts: those not locked whole that the model runs."""
    m = cfg.model
    return [name for name in TOWERS if not getattr(m, name).lock and (name == "vision" or uses_text)]


def _kind(cfg, name: str) -> str:
    return getattr(cfg.model, name).kind


def _linear_layers(tower: nn.Module) -> dict[str, nn.Linear]:
    """The tower's linear layers LoRA can adapt, by name: not those an nn.MultiheadAttention holds
    (it reads their weights in its own kernel, never calling them)."""
    held = {id(m.out_proj) for m in tower.modules() if isinstance(m, nn.MultiheadAttention)}
    return {n: m for n, m in tower.named_modules() if isinstance(m, nn.Linear) and id(m) not in held}


def _matches(pattern: str, name: str) -> bool:
    """``pattern`` matches the layer name or one of its dotted tails (peft's rule, with wildcards)."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, f"*.{pattern}")


def _targets(name: str, tower: nn.Module, kind: str, patterns: tuple[str, ...] | None) -> tuple[str, ...]:
    """The names of ``tower``'s layers the patterns (the kind's defaults when None) match; one line
    when none does."""
    layers = _linear_layers(tower)
    side = f"the {kind} {_WORDS[name]} tower"
    lock = f"model.{name}.lock: true"
    if not layers:
        raise NclipError(f"model.lora: {side} has no linear layers for LoRA to adapt; lock it ({lock}) to adapt "
                         "the other tower alone")
    chosen = tuple(n for n in layers if any(_matches(p, n) for p in patterns or DEFAULT_TARGETS[kind]))
    if not chosen:
        given = "model.lora.targets" if patterns else "the default targets"
        raise NclipError(f"model.lora: {given} match no linear layer of {side} ({_examples({name: tower})}); name "
                         f"its layers in model.lora.targets, or lock it ({lock})")
    return chosen


def _examples(towers: dict[str, nn.Module]) -> str:
    """A few names of the towers' linear layers, for a message."""
    names = [f"{_WORDS[t]} {n}" for t, tower in towers.items() for n in _linear_layers(tower)]
    if not names:
        return "it has none"
    return "its linear layers: " + ", ".join(names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4 else "")


def _check_rank(rank: int, name: str, tower: nn.Module, chosen: tuple[str, ...]) -> None:
    """A rank above a layer's narrower side makes its update full-rank: refused, naming the layer."""
    layers = _linear_layers(tower)
    for n in chosen:
        width = min(layers[n].in_features, layers[n].out_features)
        if rank > width:
            raise NclipError(f"model.lora.rank {rank} exceeds the {width} features of the {_WORDS[name]} tower's "
                             f"{n}: its update would not be low-rank (lower the rank, or train the model whole)")


# ---------------------------------------------------------------------------------------------
# the module tree with and without the adapters
# ---------------------------------------------------------------------------------------------


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """peft's LoRA layers of ``model`` by name ({} for a model without LoRA: peft is not imported)."""
    if not getattr(model, "lora_targets", None):
        return {}
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


@contextmanager
def base_layers(model: nn.Module):
    """Inside the block each LoRA layer of ``model`` is replaced by the layer it wraps: the base
    weights under their plain names, for the readers of pretrained weights (``model.init``), which
    load into the wrapped layers themselves. A model without LoRA is left as it is."""
    swapped = []
    for name, layer in lora_layers(model).items():
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, attr, layer.get_base_layer())
        swapped.append((owner, attr, layer))
    try:
        yield model
    finally:
        for owner, attr, layer in swapped:
            setattr(owner, attr, layer)


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict with each LoRA layer merged, under the plain names: W + ΔW, ΔW peft's
    ``get_delta_weight`` (what its ``merge`` adds to W), the bias as it is, the factors left out.
    The model itself is not changed (training and its evaluation go on with it)."""
    layers = lora_layers(model)
    out = {}
    for key, value in model.state_dict().items():
        owner, infix, leaf = _split(key, layers)
        if owner is None:
            out[key] = value
        elif infix == "base_layer" and leaf == "weight":
            out[f"{owner}.weight"] = value + layers[owner].get_delta_weight(ADAPTER_NAME).to(value.dtype)
        elif infix == "base_layer":
            out[f"{owner}.{leaf}"] = value
    return out


def _split(key: str, layers: dict[str, nn.Module]) -> tuple[str | None, str, str]:
    """(LoRA layer, its child, the rest) of a state-dict key inside a LoRA layer, else (None, "", "")."""
    for infix in ("base_layer", "lora_A", "lora_B", "lora_dropout", "lora_embedding_A", "lora_embedding_B"):
        owner, found, rest = key.partition(f".{infix}.")
        if found and owner in layers:
            return owner, infix, rest
    return None, "", ""


def without_lora(cfg):
    """``cfg`` with no ``model.lora``: the config of the merged model."""
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"lora": None})})


def merged_for_saving(model: nn.Module, cfg, directory: Path, metadata: dict[str, str]
                      ) -> tuple[dict[str, torch.Tensor], object]:
    """(the merged state dict, its config) for ``directory``'s model.safetensors and config.json, and
    the adapter written beside them (see the module docstring), its weights with ``metadata``."""
    state = merged_state_dict(model)
    save_adapter(model, cfg, directory, metadata)
    return state, without_lora(cfg)


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a LoRA run changes, under peft's saved names: the factors (the adapter's name left out)
    and every tensor outside the towers (heads, logit scale)."""
    layers = lora_layers(model)
    out = {}
    for key, value in model.state_dict().items():
        owner, infix, _ = _split(key, layers)
        if infix.startswith("lora_") and infix != "lora_dropout":
            out[key.replace(f".{ADAPTER_NAME}.", ".")] = value
        elif owner is None and not key.startswith(tuple(f"{t}." for t in TOWERS)):
            out[key] = value
    return out


def save_adapter(model: nn.Module, cfg, directory: Path, metadata: dict[str, str]) -> None:
    """``directory``/adapter_model.safetensors (with the safetensors header ``metadata``) and
    adapter_config.json (peft's LoraConfig, its targets named from the dual encoder, its base the run's
    ``model.init``)."""
    import peft

    lora = cfg.model.lora
    targets = sorted(f"{tower}.{n}" for tower, names in model.lora_targets.items() for n in names)
    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                             base_model_name_or_path=cfg.model.init).to_dict()
    # peft's own save_pretrained lists the targets in a set's order, which changes from process to process
    config.update(target_modules=targets, peft_version=peft.__version__)
    (Path(directory) / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
    state = {k: v.detach().contiguous().cpu() for k, v in adapter_state_dict(model).items()}
    save_file(state, str(Path(directory) / ADAPTER_WEIGHTS), metadata=metadata)


def apply_adapter(model: nn.Module, directory: str | Path) -> nn.Module:
    """Put a LoRA run's adapter (``directory``: its ``model/``) on ``model``, a dual encoder without
    LoRA holding the weights the run started from (its ``model.init``): peft's layers injected where
    adapter_config.json says, the factors, heads and logit scale loaded. Returns ``model``, unmerged."""
    import peft

    directory = Path(directory)
    if not (directory / ADAPTER_CONFIG).is_file() or not (directory / ADAPTER_WEIGHTS).is_file():
        raise NclipError(f"no LoRA adapter in {directory} (expected {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    config = peft.LoraConfig(**{k: v for k, v in json.loads((directory / ADAPTER_CONFIG).read_text()).items()
                                if k in peft.LoraConfig.__dataclass_fields__})
    targets = sorted(config.target_modules)
    for tower in TOWERS:
        names = tuple(t[len(tower) + 1:] for t in targets if t.startswith(f"{tower}."))
        if names:
            tower_config = peft.LoraConfig(r=config.r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                                           target_modules=list(names))
            peft.inject_adapter_in_model(tower_config, getattr(model, tower), adapter_name=ADAPTER_NAME)
            model.lora_targets = {**getattr(model, "lora_targets", {}), tower: names}
    layers = lora_layers(model)
    state = {}
    for key, value in load_file(str(directory / ADAPTER_WEIGHTS)).items():
        owner, infix, leaf = _split(key, layers)
        state[f"{owner}.{infix}.{ADAPTER_NAME}.{leaf}" if infix.startswith("lora_") else key] = value
    missing, unexpected = model.load_state_dict(state, strict=False)
    left = [k for k in missing if not k.startswith(tuple(f"{t}." for t in TOWERS)) or "lora_" in k]
    if left or unexpected:
        raise NclipError(f"{directory / ADAPTER_WEIGHTS} does not fit the model: missing {left[:3]}, unexpected "
                         f"{unexpected[:3]}")
    return model
