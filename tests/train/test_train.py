"""A short training run learns: the loss falls and the schedule is the configured one."""

import json

import pytest

from nclip.config import resolve
from nclip.train.loop import train
from nclip.train.optim import lr_at


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["clip", "xclip"])
def test_loss_falls(tmp_path, micro_overrides, objective):
    cfg = resolve("micro", micro_overrides + [
        f"objective.name={objective}", "train.steps=40", "train.batch_size=16", "train.lr=3e-3",
        "train.warmup_steps=4", "train.log_every=4", "train.checkpoint_every=40",
        "data.train_length=64",  # a small set seen many times: learning shows within seconds
    ])
    train(cfg, tmp_path, progress=False, evaluate=False)
    logs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    key = "clip/loss"  # InfoNCE starts at ln(B) and must fall for both objectives
    first = sum(x[key] for x in logs[:2]) / 2
    last = sum(x[key] for x in logs[-2:]) / 2
    assert last < first - 0.15, (first, last)


def test_warmup_then_cosine():
    cfg = resolve("tiny", ["train.steps=100", "train.warmup_steps=10", "train.lr=1e-3", "train.min_lr=1e-5"]).train
    assert lr_at(0, cfg) == pytest.approx(1e-4)
    assert lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(99, cfg) == pytest.approx(1e-5)
    lrs = [lr_at(s, cfg) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


@pytest.mark.slow
def test_collapse_warnings_reach_the_log_and_stderr(tmp_path, micro_overrides, monkeypatch, capsys):
    from nclip.train import monitors

    seen = []

    def fake_update(self, step, metrics):
        seen.append(metrics["nclip/L_HE"])  # the monitor is fed the logged nCLIP terms
        return ["uniform collapse: set λ1 = λ2 − 1 > 0"] if step == 4 else []

    monkeypatch.setattr(monitors.CollapseMonitor, "update", fake_update)
    train(resolve("micro", micro_overrides), tmp_path, progress=False, evaluate=False)
    logs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(seen) == len(logs)
    assert [x.get("monitor/warnings") for x in logs] == [None, ["uniform collapse: set λ1 = λ2 − 1 > 0"], None]
    assert "nclip: warning: uniform collapse" in capsys.readouterr().err
