"""Locked towers, for any objective: LiT (Zhai et al. 2022) and partial locking.

``model.vision.lock: true`` (or ``model.text.lock``) locks a whole tower: its parameters stop
requiring gradients, so they are in no optimizer group (neither the update nor weight decay can
touch them: bitwise unchanged), and the tower runs under ``torch.no_grad`` (no activations kept)
and in eval mode even while the model trains (BatchNorm uses and keeps its running statistics,
dropout is off, FLIP's patch dropout keeps every patch).

``model.vision.unlocked_layers: N`` (or ``model.text.unlocked_layers``) trains only the tower's
last N layers and what follows them (the final norm, the pooling); everything before them is
locked as above, and the locked part's BatchNorm layers are held in eval mode (their statistics
do not move either). The tower still runs with gradients (the unlocked layers need them). The
layers counted, per tower:

===============  =========================================  ===================================
tower            its layers                                 trained after the last layer
===============  =========================================  ===================================
vit              the transformer blocks (``layers``)        the final (post) LayerNorm
transformer      the transformer blocks (``layers``)        the final LayerNorm
pretrained       the encoder's layers (MiniLM-L6: 6)        the pooler (BERT-style encoders)
resnet           the stages (``len(depths)``)               nothing (global average pooling)
clip_resnet      the stages (``len(depths)``)               the attention pooling
convnet          the stages (``len(depths)``)               the attention pooling and its norm
groupvit         the stages (``len(depths)``)               the final LayerNorm
===============  =========================================  ===================================

The embeddings (patch/position/token embeddings, the ViT's pre-norm, the conv towers' stems) come
before the first layer and are locked whenever a tower is locked at all. N at most the tower's
layers (the config checks it for every tower but ``pretrained``, whose depth is known once it is
loaded: :func:`lock_towers` says it in one line then).

The heads, the logit scale and the objective's parameters are never locked. ProtoCLIP's
``lit_episode`` (App. A.1) locks the image side from that episode on with :func:`lock_image_side`:
the same whole-tower lock, plus the image-side heads. Under DDP a lock set before wrapping needs
nothing (DDP ignores parameters that do not require gradients); one set during the run (ProtoCLIP)
needs ``find_unused_parameters`` (:mod:`nclip.train.launch`).
"""

from __future__ import annotations

import functools
import types

import torch
from torch import nn

from nclip.errors import NclipError


def tower_layers(tower: nn.Module) -> list[nn.Module]:
    """The tower's layers in order (see the module docstring): what ``unlocked_layers`` counts."""
    kind = getattr(tower, "kind", None)
    if kind in ("vit", None) and hasattr(tower, "model"):
        inner = tower.model
        for attr in ("vision_model", "text_model"):  # transformers' CLIP models (versions differ)
            inner = getattr(inner, attr, inner)
        encoder = getattr(inner, "encoder", None)
        layers = getattr(encoder, "layers", None) or getattr(encoder, "layer", None)
        if layers is None:
            raise NclipError(f"cannot find the layers of the {type(inner).__name__} text encoder to lock")
        return list(layers)
    if kind == "resnet":
        return list(tower.model.encoder.stages)
    if kind == "clip_resnet":
        return list(tower.stages)
    if kind == "groupvit":
        return list(tower.model.vision_model.encoder.stages)
    if kind == "convnet":  # body: the stem's conv, BN, GELU, then per stage (a max pool and) its convs
        stages: list[list[nn.Module]] = []
        for i, module in enumerate(tower.body):
            if i == 3 or isinstance(module, nn.MaxPool2d):
                stages.append([])
            if i >= 3:
                stages[-1].append(module)
        return [nn.Sequential(*s) for s in stages]
    raise NclipError(f"cannot lock a {type(tower).__name__} tower")


def lock_tower(tower: nn.Module, unlocked_layers: int | None = None, name: str = "tower") -> None:
    """Lock ``tower`` whole (``unlocked_layers`` None) or all but its last ``unlocked_layers``
    layers and what follows them. Idempotent."""
    if unlocked_layers is None:
        _lock_whole(tower)
        return
    layers = tower_layers(tower)
    if unlocked_layers > len(layers):
        raise NclipError(f"{name}.unlocked_layers {unlocked_layers} exceeds the tower's {len(layers)} layers")
    # in registration order, the tower's own parameters last (convnet's pooling position embedding)
    params = list(dict.fromkeys([p for child in tower.children() for p in child.parameters()]
                                + list(tower.parameters(recurse=False))))
    last = {id(p) for p in layers[-1].parameters()}
    end = max(i for i, p in enumerate(params) if id(p) in last)  # what is registered after: the top
    trained = {id(p) for layer in layers[len(layers) - unlocked_layers:] for p in layer.parameters()}
    trained |= {id(p) for p in params[end + 1:]}
    for p in params:
        if id(p) not in trained:
            p.requires_grad_(False)
    hold_frozen_batchnorm(tower)


def hold_frozen_batchnorm(tower: nn.Module) -> None:
    """Every BatchNorm of ``tower`` whose parameters are all frozen held in eval mode: a frozen
    layer keeps its statistics too (a partly locked tower, a LoRA-adapted one)."""
    for module in tower.modules():
        own = list(module.parameters(recurse=False))
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and own and not any(p.requires_grad for p in own):
            hold_in_eval(module)


def lock_towers(model: nn.Module, model_cfg) -> None:
    """Apply ``model.vision`` and ``model.text``'s ``lock``/``unlocked_layers`` to a DualEncoder
    (call before the optimizer and the DDP wrapper are built)."""
    for attr, section in (("vision", model_cfg.vision), ("text", model_cfg.text)):
        if section.lock or section.unlocked_layers is not None:
            lock_tower(getattr(model, attr), None if section.lock else section.unlocked_layers, f"model.{attr}")


def lock_image_side(model: nn.Module) -> None:
    """ProtoCLIP's locked-image tuning: the image tower locked whole and the image-side heads
    (each head's ``image*`` modules) frozen. Idempotent."""
    _lock_whole(model.vision)
    for head in model.heads.values():
        for module in head.side_modules("image"):
            module.requires_grad_(False)


def is_locked(tower: nn.Module) -> bool:
    """Whether ``tower`` is locked whole."""
    return bool(getattr(tower, "_nclip_locked", False))


def _lock_whole(tower: nn.Module) -> None:
    if is_locked(tower):
        return
    tower.requires_grad_(False)
    forward = tower.forward

    @functools.wraps(forward)
    def locked_forward(*args, **kwargs):
        with torch.no_grad():
            return forward(*args, **kwargs)

    tower.forward = locked_forward
    hold_in_eval(tower)
    tower._nclip_locked = True


def hold_in_eval(module: nn.Module) -> None:
    """``module`` and everything in it in eval mode from now on, whatever ``train()`` is asked."""
    def train(self, mode: bool = True):
        return nn.Module.train(self, False)

    module.train = types.MethodType(train, module)
    module.train(False)
    module._nclip_held_in_eval = True


def is_held_in_eval(module: nn.Module) -> bool:
    """Whether :func:`hold_in_eval` holds ``module`` (a layer replacing it must be held too)."""
    return bool(getattr(module, "_nclip_held_in_eval", False))
