"""train.compile: the towers compiled in place (same state-dict keys, same loss as eager to float
tolerance), and eager with one warning line where torch.compile fails."""

from __future__ import annotations

import json

import pytest
import torch

import nclip.train.compile as compile_mod
from nclip.config import resolve
from nclip.models import build_model
from nclip.objectives import build_objective
from nclip.precision import to_float32
from nclip.train.loop import train

from conftest import micro_sizes

OVERRIDES = micro_sizes() + ["train.steps=2", "train.batch_size=8", "train.warmup_steps=1", "train.log_every=1",
                             "train.threads=1", "data.train_length=64"]


def _micro_loss(compiled: bool) -> tuple[float, list[str]]:
    cfg = resolve("micro", OVERRIDES)
    torch.manual_seed(0)
    model, objective = build_model(cfg, pretrained_text=False), build_objective(cfg.objective, cfg)
    keys = list(model.state_dict())
    if compiled:
        assert compile_mod.compile_towers(model)
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(8, 3, 16, 16, generator=g)
    ids = torch.randint(1000, 5000, (8, 16), generator=g)
    loss = objective(to_float32(model(pixels, ids, torch.ones_like(ids))))["loss"]
    loss.backward()
    assert list(model.state_dict()) == keys  # compiled in place: checkpoints are unchanged
    return loss.item(), keys


def test_a_failing_compiler_leaves_the_towers_eager_with_one_warning(monkeypatch, capsys):
    def broken(device):
        raise RuntimeError("no C++ compiler\nmore detail")

    monkeypatch.setattr(compile_mod, "_probe", broken)
    model = build_model(resolve("micro", OVERRIDES), pretrained_text=False)
    assert not compile_mod.compile_towers(model)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.compile" in err[0] and "no C++ compiler" in err[0] and "eagerly" in err[0]
    assert getattr(model.vision, "_compiled_call_impl", None) is None


def test_a_run_with_a_failing_compiler_trains_as_eager(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_mod, "_probe", lambda device: (_ for _ in ()).throw(RuntimeError("nope")))
    losses = []
    for name, extra in (("eager", []), ("compiled", ["train.compile=true"])):
        train(resolve("micro", OVERRIDES + extra), tmp_path / name, progress=False, evaluate=False)
        losses.append([json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").open()])
    assert losses[0] == losses[1]


@pytest.mark.slow
def test_compiled_towers_give_the_eager_loss():
    try:
        compile_mod._probe(torch.device("cpu"))
    except Exception as e:  # this torch build cannot compile: the fallback tests above cover it
        pytest.skip(f"torch.compile unavailable: {e}")
    eager, _ = _micro_loss(False)
    compiled, _ = _micro_loss(True)
    assert compiled == pytest.approx(eager, rel=1e-4, abs=1e-5)


@pytest.mark.slow
def test_a_compiled_run_trains_a_micro_step(tmp_path):
    result = train(resolve("micro", OVERRIDES + ["train.compile=true"]), tmp_path / "run", progress=False,
                   evaluate=False)
    assert result.steps == 2 and torch.isfinite(torch.tensor(result.metrics["loss"]))
