"""train.ema: the weights' moving average — its update, the step gate, export, end-of-run eval,
exact resume and 2-rank agreement."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from nclip.config import resolve
from nclip.errors import NclipError
from nclip.train.checkpoint import list_checkpoints, read_checkpoint
from nclip.train.ema import WeightEMA, evaluate_with_ema, swapped_to_ema
from nclip.train.loop import train

from conftest import MICRO_OVERRIDES

OVERRIDES = [*MICRO_OVERRIDES, "train.steps=8", "train.checkpoint_every=4", "train.keep_checkpoints=3",
             "train.threads=1", "data.train_length=128", "train.ema=0.9"]


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double()
    model[2].bias.requires_grad_(False)  # a frozen parameter is not averaged
    return model


def test_update_is_the_exponential_moving_average_of_taken_steps():
    model = _model()
    ema = WeightEMA(model, 0.9)
    assert len(ema.names) == 5 and "2.bias" not in ema.names
    expected = [p.detach().clone() for p in ema.params]
    for step in range(4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        taken = torch.tensor(0.0 if step == 2 else 1.0, dtype=torch.float64)
        before = [a.clone() for a in ema.averages]
        ema.update(taken)
        if step == 2:  # a skipped step: bitwise as it was
            assert all(torch.equal(a, b) for a, b in zip(ema.averages, before))
            continue
        expected = [0.9 * e + 0.1 * p.detach() for e, p in zip(expected, ema.params)]
        for a, e in zip(ema.averages, expected):
            torch.testing.assert_close(a, e, rtol=1e-14, atol=1e-14)


def test_update_reads_nothing_on_the_host_and_equals_the_scalar_lerp_bitwise():
    """The weight goes to lerp as a device tensor (a 0-d tensor given as lerp's number weight is read
    with item(): a host sync per step on CUDA); on the CPU the result is the number-weight lerp's, bit
    for bit, in every dtype the model holds."""
    from torch.profiler import ProfilerActivity, profile

    model = _model()
    model[0].float()  # a second dtype: each parameter's weight has its own dtype
    ema = WeightEMA(model, 0.999)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    expected = [a.clone() for a in ema.averages]
    weight = (torch.tensor(1.0) * (1.0 - 0.999)).to(ema.params[0].dtype).item()
    torch._foreach_lerp_(expected, ema.params, weight)
    taken = torch.ones(())
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        ema.update(taken)
    reads = [e.name for e in prof.events() if e.name in ("aten::_local_scalar_dense", "aten::item", "aten::lift_fresh")]
    assert not reads
    assert {a.dtype for a in ema.averages} == {torch.float32, torch.float64}
    assert all(torch.equal(a, e) for a, e in zip(ema.averages, expected))


def test_swapped_to_ema_puts_the_weights_back_bitwise_even_on_error():
    model = _model()
    ema = WeightEMA(model, 0.5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update()
    raw = {k: v.clone() for k, v in model.state_dict().items()}
    with swapped_to_ema(model, ema):
        for name, avg in ema.state_dict().items():
            assert torch.equal(model.get_parameter(name), avg)
        assert torch.equal(model[2].bias, raw["2.bias"])  # frozen: the live one
    with pytest.raises(RuntimeError), swapped_to_ema(model, ema):
        raise RuntimeError("boom")
    assert all(torch.equal(v, raw[k]) for k, v in model.state_dict().items())
    with swapped_to_ema(model, None) as same:  # no EMA: nothing swapped
        assert same is model
    calls = []
    out = evaluate_with_ema(lambda m: calls.append(m[0].weight.sum().item()) or {"top1": len(calls)}, model, ema)
    assert out == {"top1": 1, "ema/top1": 2, "ema/decay": 0.5} and calls[0] != calls[1]


@pytest.mark.parametrize("bad", ["train.ema=1", "train.ema=-0.1", "train.ema=0.99 train.strategy=fsdp"])
def test_bad_decays_are_one_line_config_errors(bad):
    with pytest.raises(NclipError) as e:
        resolve("micro", bad.split())
    assert "\n" not in str(e.value) and "ema" in str(e.value)


@pytest.mark.slow
def test_export_eval_and_checkpoint(tmp_path):
    result = train(resolve("micro", OVERRIDES), tmp_path, progress=False)
    _, state = read_checkpoint(list_checkpoints(tmp_path)[-1])
    weights = load_file(str(list_checkpoints(tmp_path)[-1] / "model.safetensors"))
    exported = load_file(str(tmp_path / "model" / "model.safetensors"))
    raw = load_file(str(tmp_path / "model-raw" / "model.safetensors"))
    assert set(state["ema"]) and set(state["ema"]) <= set(exported)
    for name, tensor in exported.items():  # model/ = the average; model-raw/ = the trained weights
        assert torch.equal(tensor, state["ema"].get(name, weights[name])), name
        assert torch.equal(raw[name], weights[name]), name
    assert any(not torch.equal(exported[n], raw[n]) for n in state["ema"])
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert saved == result.eval and saved["ema/decay"] == 0.9
    plain = [k for k in saved if not k.startswith("ema/")]
    assert plain and all(f"ema/{k}" in saved for k in plain)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("train.accumulation=2",)], ids=["k1", "exact-k2"])
def test_resume_continues_the_average_exactly(tmp_path, extra):
    cfg = resolve("micro", [*OVERRIDES, *extra])
    reference = tmp_path / "reference"
    train(cfg, reference, progress=False, evaluate=False)
    run = tmp_path / "run"
    train(cfg, run, progress=False, evaluate=False)
    for name in ("checkpoints/step_00000008", "model", "model-raw"):  # as if killed after step 4's checkpoint
        shutil.rmtree(run / name)
    train(cfg, run, resume=True, progress=False, evaluate=False)
    _, want = read_checkpoint(list_checkpoints(reference)[-1])
    _, got = read_checkpoint(list_checkpoints(run)[-1])
    assert got["step"] == 8 and set(got["ema"]) == set(want["ema"])
    assert all(torch.equal(got["ema"][k], want["ema"][k]) for k in want["ema"])
    for d in ("model", "model-raw"):
        assert load_file(str(run / d / "model.safetensors")).keys() == load_file(
            str(reference / d / "model.safetensors")).keys()
        a, b = (load_file(str(r / d / "model.safetensors")) for r in (run, reference))
        assert all(torch.equal(a[k], b[k]) for k in b), d


@pytest.mark.slow
def test_a_skipped_step_leaves_the_average_alone(tmp_path, monkeypatch):
    from test_faults import _poison_batches

    import nclip.train.loop as loop_mod

    _poison_batches(monkeypatch, {3})  # the 4th step is skipped
    seen = []

    def recording(model, decay, state=None):
        ema = real(model, decay, state)
        update = ema.update

        def update_and_record(taken):
            update(taken)
            seen.append([a.clone() for a in ema.averages])
        ema.update = update_and_record
        return ema

    real = loop_mod.ema_for
    monkeypatch.setattr(loop_mod, "ema_for", recording)
    train(resolve("micro", OVERRIDES), tmp_path, progress=False, evaluate=False)
    assert len(seen) == 8
    same = [all(torch.equal(a, b) for a, b in zip(seen[i], seen[i + 1])) for i in range(7)]
    assert same == [False, False, True, False, False, False, False]  # after step 3 = after step 4
