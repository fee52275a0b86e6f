"""``train.precision: fp16`` (nclip.train.loss_scale): the loss scale is exact where it is taken out,
backs off and grows on the device, skips overflowing steps through the step gate bitwise, and
resumes bitwise."""

from __future__ import annotations

import copy
import json
import math
import shutil

import pytest
import torch
from torch import nn

import nclip.train.loop as loop_mod
from nclip.config import resolve
from nclip.precision import autocast_dtype
from nclip.train import loss_scale as loss_scale_mod
from nclip.train.checkpoint import list_checkpoints, read_checkpoint
from nclip.train.gate import StepGate
from nclip.train.logbook import WALL_CLOCK
from nclip.train.loop import train
from nclip.train.loss_scale import INIT_SCALE, LossScale

from conftest import micro_sizes

CPU = torch.device("cpu")
RUN = micro_sizes() + ["train.batch_size=8", "data.train_length=64", "train.eval_every=0", "train.threads=1",
                       "train.precision=fp16", "train.warmup_steps=1"]


def test_fp16_is_float16_autocast_on_every_device():
    assert resolve("micro", ["train.precision=fp16"]).train.precision == "fp16"
    assert autocast_dtype("fp16", CPU) == torch.float16
    assert autocast_dtype("fp16", torch.device("cuda")) == torch.float16
    assert autocast_dtype("auto", CPU) is None


@pytest.mark.parametrize("exponent", [1, 16, 24, 40])
def test_the_norm_of_scaled_gradients_over_the_scale_is_the_norm_bitwise(exponent):
    """S = 2^k: the squares, their sum and the square root move by exact powers of two."""
    torch.manual_seed(exponent)
    grads = [torch.randn(37, 5) * 10.0 ** torch.randint(-6, 3, (37, 1)), torch.randn(300) * 1e-4, torch.randn(())]
    scale = LossScale(CPU)
    scale.scale.fill_(2.0**exponent)
    norm = torch.nn.utils.get_total_norm(grads)
    scaled = torch.nn.utils.get_total_norm([g * scale.scale for g in grads])
    assert torch.equal(scale.unscaled(scaled), norm)
    assert not torch.equal(scaled, norm)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    return torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    torch.manual_seed(100 + step)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    return ((model(x) - y) ** 2).sum()


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_scaled_clipped_step_is_bitwise_the_unscaled_one(optimizer):
    """What the loop does under fp16 (backward of S·loss, StepGate.grad_norm: norm ÷ S and the clip with
    it, the fused kernel dividing by S) gives the bits of an fp32 step clipped with clip_grad_norm_."""
    plain, scaled = _model(), _model()
    opt_plain, opt_scaled = _optimizer(plain, optimizer), _optimizer(scaled, optimizer)
    gate = StepGate(opt_scaled, CPU, {}, torch.float16)
    for step in range(3):
        _loss(plain, step).backward()
        raw = plain[0].weight.grad.clone()
        norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
        opt_plain.step()
        opt_plain.zero_grad()

        gate.scaled(_loss(scaled, step)).backward()
        assert torch.equal(scaled[0].weight.grad, raw * INIT_SCALE)  # the backward of S·loss: S·g exactly
        got = gate.grad_norm(0.5)
        gate.step(gate.decide(torch.zeros(()), got))
        opt_scaled.zero_grad()

        assert norm > 0.5 and torch.equal(got, norm), step  # it did clip
        assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), scaled.state_dict().values()))
    assert gate.counters() == {"nonfinite_total": 0, "nonfinite_row": 0}
    assert gate.loss_scale.scale == INIT_SCALE and gate.loss_scale.growth_tracker == 3


def test_an_overflow_is_skipped_bitwise_and_the_scale_backs_off_then_grows(monkeypatch):
    monkeypatch.setattr(loss_scale_mod, "GROWTH_INTERVAL", 2)
    model = _model()
    opt = _optimizer(model, "adamw")
    gate = StepGate(opt, CPU, {}, torch.float16)

    def step(overflow: bool) -> None:
        gate.scaled(_loss(model, 0)).backward()
        if overflow:  # as a float16 backward that overflowed leaves them
            next(model.parameters()).grad[0, 0] = float("inf")
        gate.step(gate.decide(torch.zeros(()), gate.grad_norm(None)))
        opt.zero_grad()

    step(False)
    before = copy.deepcopy((model.state_dict(), opt.state_dict()))
    step(True)
    after = (model.state_dict(), opt.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(before[0].values(), after[0].values()))
    for p, state in before[1]["state"].items():
        assert all(torch.equal(v, after[1]["state"][p][k]) for k, v in state.items())
    assert gate.loss_scale.scale == INIT_SCALE / 2 and gate.loss_scale.growth_tracker == 0
    assert gate.counters() == {"nonfinite_total": 1, "nonfinite_row": 1}
    step(False)
    step(False)  # two taken steps in a row: the scale grows back
    assert gate.loss_scale.scale == INIT_SCALE and gate.loss_scale.growth_tracker == 0
    again = StepGate(opt, CPU, {}, torch.float16, gate.checkpoint_state()).loss_scale
    assert torch.equal(again.scale, gate.loss_scale.scale) and torch.equal(again.growth_tracker,
                                                                           gate.loss_scale.growth_tracker)


def _rows(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_fp16_trains_logs_unscaled_norms_and_resumes_bitwise(tmp_path, monkeypatch):
    """A micro xCLIP run: finite, its gradient norm that of the gradients (as float32's, to float16's
    rounding, not 2^16 times it), and a resume continues with the saved scale and growth count: the
    scale grows every 4 steps here, so a resume that restarted either would log or save other values."""
    monkeypatch.setattr(loss_scale_mod, "GROWTH_INTERVAL", 4)
    run = tmp_path / "fp16"
    cfg = resolve("micro", RUN + ["train.steps=7", "train.log_every=1", "train.checkpoint_every=3"])
    train(cfg, run, progress=False, evaluate=False)
    first, (*_, last) = _rows(run), list_checkpoints(run)
    final = read_checkpoint(last)[1]["loss_scale"]
    assert final == {"scale": INIT_SCALE * 2, "growth_tracker": 3}
    assert read_checkpoint(list_checkpoints(run)[-2])[1]["loss_scale"] == {"scale": INIT_SCALE * 2,
                                                                          "growth_tracker": 2}
    shutil.rmtree(last)  # killed before step 7's checkpoint: resume from step 6
    train(cfg, run, resume=True, progress=False, evaluate=False)
    assert _without_wall_clock(_rows(run)) == _without_wall_clock(first)
    assert read_checkpoint(list_checkpoints(run)[-1])[1]["loss_scale"] == final

    assert [r["loss_scale"] for r in first] == [INIT_SCALE] * 4 + [INIT_SCALE * 2] * 3
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in first)
    assert all(r["nonfinite_steps"] == 0 for r in first)
    fp32 = tmp_path / "fp32"
    train(resolve("micro", RUN + ["train.precision=fp32", "train.steps=1"]), fp32, progress=False, evaluate=False)
    want, got = _rows(fp32)[0]["grad_norm"], first[0]["grad_norm"]
    assert abs(got - want) < 0.01 * want, (got, want)
    assert "loss_scale" not in _rows(fp32)[0]


def _without_wall_clock(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in WALL_CLOCK} for r in rows]


@pytest.mark.slow
def test_an_overflowing_fp16_step_leaves_weights_optimizer_and_buffers_untouched(tmp_path, monkeypatch):
    """Step 3 of a micro xCLIP run (BatchNorm in the nCLIP heads) runs with S = 2^100: the float16
    backward overflows, the gate skips the step and the scale halves. (The test then puts S back to
    2^16, which 99 more halvings would reach, so that the run goes on.)"""
    real_step, seen = loop_mod._step, {}

    def step(info, learner, index, batch):
        if index == 3:
            learner.gate.loss_scale.scale.fill_(INIT_SCALE)
        if index != 2:
            return real_step(info, learner, index, batch)
        learner.gate.loss_scale.scale.fill_(2.0**100)
        before = copy.deepcopy((learner.step_module.state_dict(), learner.optimizer.state_dict()))
        result = real_step(info, learner, index, batch)
        seen["after"] = copy.deepcopy((learner.step_module.state_dict(), learner.optimizer.state_dict()))
        seen["before"], seen["scale"] = before, learner.gate.loss_scale.scale.clone()
        return result

    monkeypatch.setattr(loop_mod, "_step", step)
    train(resolve("micro", RUN + ["train.steps=5", "train.log_every=1"]), tmp_path, progress=False, evaluate=False)
    (weights, opt), (weights_after, opt_after) = seen["before"], seen["after"]
    assert any("running_var" in k for k in weights)
    assert weights.keys() == weights_after.keys()
    assert all(torch.equal(weights[k], weights_after[k]) for k in weights)
    assert opt["state"].keys() == opt_after["state"].keys()
    for p, state in opt["state"].items():
        assert all(torch.equal(v, opt_after["state"][p][k]) for k, v in state.items()), p
    assert seen["scale"] == 2.0**99
    rows = _rows(tmp_path)
    assert [r["nonfinite_steps"] for r in rows] == [0, 0, 1, 1, 1]
    assert math.isfinite(rows[2]["loss"]) and not math.isfinite(rows[2]["grad_norm"])  # the backward overflowed
    assert [r["loss_scale"] for r in rows] == [INIT_SCALE, INIT_SCALE, 2.0**100, INIT_SCALE, INIT_SCALE]
    assert all(math.isfinite(r["grad_norm"]) for i, r in enumerate(rows) if i != 2)
