"""Each model built once for the whole bench: later rows get a copy of its initial weights.

A ViT-B/16 xCLIP model has 414 M parameters; building one (modules, random initialisation, the
text tower's pretrained weights where configured) takes seconds, and the bench's rows used to build
one each: the hand loop, every :func:`nclip.train.loop.train` run, the evaluation row, every
largest-batch point, about 16 in all. Inside :func:`shared_models` the first request for a model
builds it (:func:`nclip.models.build_model`) and keeps it, untouched, on the CPU; every request,
the first included, gets a deep copy of it (a memory copy, no initialisation), so each row still
owns its model (moved, compiled, trained as the row needs) and starts from the same weights.
``train()`` asks through its module's ``build_model``, which is swapped for the block's
duration (as :func:`nclip.bench.patch_dropout_rate._rates_from` swaps its rate).

Models differ where what :func:`~nclip.models.build_model` reads differs (:func:`model_key`): the
model and data sections, the heads the objective needs, the pretrained text weights or not.
Everything else (batch size, steps, accumulation, compilation) is the row's.

:attr:`ModelCache.builds` and :attr:`ModelCache.copies` count what the block did, for the JSON's
stage records and the budget's estimates (:attr:`ModelCache.build_s`, :attr:`ModelCache.copy_s`:
the seconds each took, measured here).
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
from collections.abc import Iterator

import torch
from torch import nn

_active: ModelCache | None = None


def model_key(cfg, pretrained_text: bool = True) -> str:
    """What :func:`nclip.models.build_model` builds from ``cfg``, as a string: two configs with
    the same key get the same model (architecture and initial weights)."""
    from nclip.objectives import plan_for

    heads = sorted(plan_for(cfg).heads)
    return json.dumps([cfg.model.model_dump(mode="json"), cfg.data.model_dump(mode="json"), heads, cfg.seed,
                       bool(pretrained_text)], sort_keys=True)


class ModelCache:
    """Models built once per :func:`model_key` (module docstring)."""

    def __init__(self):
        self.templates: dict[str, tuple] = {}  # key: (the model as built, the CPU RNG state the build left)
        self.builds = self.copies = 0
        self.build_s: list[float] = []  # seconds of each build
        self.copy_s: list[float] = []  # seconds of each copy

    def has(self, cfg, pretrained_text: bool = True) -> bool:
        return model_key(cfg, pretrained_text) in self.templates

    def get(self, cfg, pretrained_text: bool = True) -> nn.Module:
        """A model of ``cfg`` of its own (on the CPU), the one built with ``torch.manual_seed(cfg.seed)``;
        the RNG is left as that build leaves it, so a copy draws nothing a build would not have."""
        template, rng_after = self.prepare(cfg, pretrained_text)
        torch.set_rng_state(rng_after)  # what comes next (the objective) draws as after a build
        t0 = time.perf_counter()
        # the tokenizer is read-only: the copies share it
        model = copy.deepcopy(template, memo={id(template.tokenizer): template.tokenizer})
        self.copies += 1
        self.copy_s.append(time.perf_counter() - t0)
        return model

    def prepare(self, cfg, pretrained_text: bool = True) -> tuple[nn.Module, torch.Tensor]:
        """``cfg``'s model as first built, building it if need be (no copy), with the RNG state after that build."""
        import nclip.models

        key = model_key(cfg, pretrained_text)
        torch.manual_seed(cfg.seed)  # the RNG a build starts from, every time (what the trainer does)
        if key not in self.templates:
            t0 = time.perf_counter()
            model = nclip.models.build_model(cfg, pretrained_text=pretrained_text)
            self.templates[key] = model, torch.get_rng_state()
            self.builds += 1
            self.build_s.append(time.perf_counter() - t0)
        return self.templates[key]

    def counts(self) -> dict:
        return {"builds": self.builds, "copies": self.copies}


def build(cfg, pretrained_text: bool = True) -> nn.Module:
    """``cfg``'s model: from the active :func:`shared_models` block's cache, else built."""
    if _active is not None:
        return _active.get(cfg, pretrained_text)
    import nclip.models

    return nclip.models.build_model(cfg, pretrained_text=pretrained_text)


@contextlib.contextmanager
def shared_models() -> Iterator[ModelCache]:
    """A :class:`ModelCache` that :func:`build` and :func:`nclip.train.loop.train` use until the block
    ends (nested blocks share the outer cache)."""
    global _active
    if _active is not None:
        yield _active
        return
    import nclip.train.loop as loop

    cache, real = ModelCache(), loop.build_model
    _active, loop.build_model = cache, cache.get
    try:
        yield cache
    finally:
        _active, loop.build_model = None, real
