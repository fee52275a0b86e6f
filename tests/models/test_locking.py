"""Locked towers (model.vision/text.lock, unlocked_layers): which parameters train per tower kind,
locked ones out of the optimizer and bitwise unchanged by training (weight decay included),
no_grad and eval mode for a whole locked tower, one-line config errors, and 2 ranks under DDP."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from nclip.config import resolve
from nclip.errors import NclipError
from nclip.models import build_model
from nclip.models.locking import is_locked, lock_towers, tower_layers
from nclip.train.optim import build_optimizer

from conftest import MICRO_OVERRIDES, micro_sizes

CONV = ["model.vision.depths=[1,1]", "model.vision.hidden_sizes=[16,32]", "model.vision.embedding_size=16",
        "model.vision.heads=2"]


def _model(*extra):
    cfg = resolve("micro", micro_sizes() + list(extra))
    torch.manual_seed(cfg.seed)
    model = build_model(cfg)
    lock_towers(model, cfg.model)
    return cfg, model


def _trainable(module) -> set[str]:
    return {n for n, p in module.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("kind, top", [("vit", "post_layernorm"), ("resnet", None), ("clip_resnet", "pool."),
                                       ("convnet", "pool.")])
def test_unlocked_layers_train_the_last_layers_and_the_top(kind, top):
    extra = [f"model.vision.kind={kind}", *(CONV if kind != "vit" else ["model.vision.layers=2"])]
    _, full = _model(*extra)
    cfg, model = _model(*extra, "model.vision.unlocked_layers=1", "train.weight_decay=0.5")
    layers = tower_layers(model.vision)
    assert len(layers) == 2
    last = {id(p) for p in layers[-1].parameters()}
    first = {id(p) for p in layers[0].parameters()}
    trained = {id(p) for p in model.vision.parameters() if p.requires_grad}
    assert last <= trained and not first & trained
    names = _trainable(model.vision)
    if top:
        assert any(top in n for n in names)
    assert names < _trainable(full.vision)
    assert not is_locked(model.vision) and _trainable(model.text) == _trainable(full.text)
    in_optimizer = {id(p) for g in build_optimizer([model], cfg.train).param_groups for p in g["params"]}
    locked = {id(p) for p in model.vision.parameters() if not p.requires_grad}
    assert locked and not locked & in_optimizer and trained <= in_optimizer


def test_text_towers_lock_by_their_blocks():
    _, model = _model("model.text.layers=2", "model.text.unlocked_layers=1")
    names = _trainable(model.text)
    assert all(".layers.1." in n or "final_layer_norm" in n for n in names) and names
    _, minilm = _model("model.text.kind=pretrained", "model.text.unlocked_layers=2")
    assert len(tower_layers(minilm.text)) == 6
    assert {n.split(".")[3] for n in _trainable(minilm.text) if ".layer." in n} == {"4", "5"}
    with pytest.raises(NclipError, match="model.text.unlocked_layers 7 exceeds the tower's 6 layers"):
        _model("model.text.kind=pretrained", "model.text.unlocked_layers=7")


def test_a_locked_tower_runs_without_gradients_in_eval_mode():
    _, model = _model("model.vision.kind=convnet", *CONV, "model.vision.lock=true")
    assert is_locked(model.vision) and not _trainable(model.vision)
    model.train()
    assert not model.vision.training and not any(m.training for m in model.vision.modules())
    assert model.text.training
    out = model.vision(torch.randn(2, 3, 16, 16))
    assert not out.requires_grad and out.grad_fn is None


@pytest.mark.parametrize("bad, message", [
    ("model.vision.lock=true model.vision.unlocked_layers=1", "model.vision: give lock or unlocked_layers, not both"),
    ("model.vision.unlocked_layers=2", "model.vision.unlocked_layers 2 exceeds the tower's 1 layers"),
    ("model.text.unlocked_layers=3", "model.text.unlocked_layers 3 exceeds the tower's 1 layers"),
    ("model.text.lock=true model.text.unlocked_layers=1", "model.text: give lock or unlocked_layers, not both"),
    ("model.vision.unlocked_layers=0", "unlocked_layers"),
])
def test_bad_lock_settings_are_one_line_errors(bad, message):
    with pytest.raises(NclipError, match=message) as e:
        resolve("micro", micro_sizes() + bad.split())
    assert "\n" not in str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("train.accumulation=2",)], ids=["k1", "exact-k2"])
def test_locked_parameters_stay_bitwise_unchanged_by_training(tmp_path, extra):
    from nclip.train.loop import train

    cfg = resolve("micro", [*MICRO_OVERRIDES, "model.vision.kind=convnet", *CONV, "model.vision.lock=true",
                            "model.text.unlocked_layers=1", "train.weight_decay=0.5", "train.threads=1",
                            "data.train_length=64", "train.ema=0.5", *extra])
    torch.manual_seed(cfg.seed)
    start = build_model(cfg).state_dict()  # the run's initial weights (same seed, same order)
    train(cfg, tmp_path, progress=False, evaluate=False)
    end = load_file(str(tmp_path / "model-raw" / "model.safetensors"))
    ema = load_file(str(tmp_path / "model" / "model.safetensors"))
    for k, v in end.items():
        if k.startswith("vision.") or k.startswith("text.model.embeddings."):  # BN statistics too
            assert torch.equal(v, start[k]) and torch.equal(ema[k], start[k]), k
    moved = [k for k in end if k.startswith("text.model.encoder.") and not torch.equal(end[k], start[k])]
    assert moved and any(not torch.equal(end[k], start[k]) for k in end if k.startswith("heads."))


def _rank(rank: int, world: int, root: str):
    from pathlib import Path

    import nclip.train.loop as loop_mod

    seen = {}
    real = loop_mod.ema_for

    def keep(model, decay, state=None):
        seen["ema"] = real(model, decay, state)
        seen["model"] = model
        return seen["ema"]

    loop_mod.ema_for = keep
    cfg = resolve("micro", [*MICRO_OVERRIDES, "train.steps=3", "model.vision.unlocked_layers=1",
                            "model.vision.layers=2", "model.text.lock=true", "train.ema=0.5", "train.threads=1",
                            "data.train_length=64"])
    loop_mod.train(cfg, Path(root) / "run", progress=False, evaluate=False)
    return {"ema": {k: v.clone() for k, v in seen["ema"].state_dict().items()},
            "weights": {k: v.detach().clone() for k, v in seen["model"].state_dict().items()}}


@pytest.mark.slow
def test_two_ranks_hold_the_same_weights_and_average_with_locked_towers(tmp_path):
    from distributed_utils import run_ranks

    a, b = run_ranks(_rank, 2, args=(str(tmp_path),))
    assert a["ema"].keys() == b["ema"].keys() and a["ema"]
    assert not any(k.startswith("text.") or ".layers.0." in k for k in a["ema"])  # locked: not averaged
    for part in ("ema", "weights"):
        assert all(torch.equal(a[part][k], b[part][k]) for k in a[part]), part
