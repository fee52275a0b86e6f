"""CollapseMonitor on synthetic metric streams shaped like Appendix B.1 / Fig. B1."""

import math

import pytest
import torch

from nclip.train.monitors import CollapseMonitor

K = 1024
LN_K = math.log(K)


def healthy(step, prefix="nclip"):
    """A stable run (B.1 case 3): L_EH falls, L_HE stays near ln K, L_KL grows, usage high."""
    eh = LN_K - 0.5 - 5.0 * (1 - math.exp(-step / 20))
    return {
        "loss": 3.0 - 0.01 * step,
        f"{prefix}/L_EH": eh,
        f"{prefix}/L_HE": LN_K - 0.05,
        f"{prefix}/L_KL": 0.3 + 0.02 * step,
        f"{prefix}/L_CE": eh + 0.3 + 0.02 * step,
        f"{prefix}/row_std": (2.0 + 0.2 * step) / K,
        f"{prefix}/usage": 0.93 + 0.01 * math.sin(step),
    }


def uniform_collapsed(step):
    return {
        "loss": -0.0 * LN_K,
        "nclip/L_EH": LN_K - 1e-5,
        "nclip/L_HE": LN_K - 1e-6,
        "nclip/L_KL": 1e-7,
        "nclip/L_CE": LN_K,
        "nclip/row_std": 1e-9,
        "nclip/usage": 1 / K,  # argmax of a flat row: the symptom must not be reported as its own collapse
    }


def run(monitor, stream):
    return [(step, w) for step, m in stream for w in monitor.update(step, m)]


def test_healthy_stream_is_silent():
    mon = CollapseMonitor(K, batch_size=4096, lambda1=0.5, lambda2=1.5)
    assert run(mon, [(s, healthy(s)) for s in range(200)]) == []
    assert mon.healthy


def test_constant_uniform_collapse_warns_once_with_the_fix():
    mon = CollapseMonitor(K, batch_size=4096, lambda1=0.0, lambda2=1.0, window=5)
    stream = [(s, healthy(s)) for s in range(10)] + [(s, uniform_collapsed(s)) for s in range(10, 60)]
    fired = run(mon, stream)
    assert len(fired) == 1
    step, msg = fired[0]
    assert step == 14  # the fifth collapsed log
    assert "uniform collapse" in msg and "λ1 = λ2 − 1 > 0" in msg and "now λ1 = 0" in msg
    assert f"{(1 + 0.0 - 1.0) * LN_K:.4f}" in msg  # the collapsed loss value
    assert not mon.healthy and set(mon.warned) == {"uniform"}


def test_short_blip_does_not_warn_and_recurrence_warns_again():
    mon = CollapseMonitor(K, window=4)
    blip = [(s, uniform_collapsed(s)) for s in range(3)] + [(s, healthy(s)) for s in range(3, 10)]
    assert run(mon, blip) == []
    again = [(s, uniform_collapsed(s)) for s in range(10, 14)] + [(s, healthy(s)) for s in range(14, 20)]
    again += [(s, uniform_collapsed(s)) for s in range(20, 30)]
    assert [s for s, _ in run(mon, again)] == [13, 23]


def test_dimensional_collapse():
    mon = CollapseMonitor(K, batch_size=4096, lambda1=0.5, lambda2=1.0)
    stream = [(s, healthy(s)) for s in range(20)]
    for s in range(20, 40):
        m = healthy(s)
        m["nclip/usage"] = 0.08  # most prototypes are nobody's argmax
        stream.append((s, m))
    fired = run(mon, stream)
    assert len(fired) == 1 and "dimensional collapse" in fired[0][1] and "Increase λ2" in fired[0][1]
    assert fired[0][0] == 24


def test_dimensional_collapse_without_batch_size_uses_the_peak():
    mon = CollapseMonitor(K, window=3)
    stream = [(s, {**healthy(s), "nclip/usage": 0.12}) for s in range(5)]  # B < K caps usage: fine
    assert run(mon, stream) == []
    fired = run(mon, [(s, {**healthy(s), "nclip/usage": 0.02}) for s in range(5, 10)])
    assert [s for s, _ in fired] == [7] and "peak" in fired[0][1]


def test_one_hot_collapse_is_named_as_such():
    mon = CollapseMonitor(K, batch_size=4096)
    stream = [(s, healthy(s)) for s in range(5)]
    stream += [(s, {"nclip/L_EH": 0.01, "nclip/L_HE": 0.02, "nclip/L_KL": 0.0, "nclip/row_std": 0.03,
                    "nclip/usage": 1 / K}) for s in range(5, 20)]
    fired = run(mon, stream)
    assert len(fired) == 1 and "one-hot collapse" in fired[0][1] and "increase λ2" in fired[0][1]


def test_nonfinite_warns_immediately_and_prefix_is_detected():
    mon = CollapseMonitor(K)
    stream = [(s, healthy(s, prefix="unified")) for s in range(3)]
    stream.append((3, {**healthy(3, prefix="unified"), "loss": float("nan")}))
    stream.append((4, {**healthy(4, prefix="unified"), "loss": float("nan")}))
    fired = run(mon, stream)
    assert mon.prefix == "unified"
    assert [s for s, _ in fired] == [3] and "non-finite loss" in fired[0][1]


def test_tensor_values_and_no_head_metrics():
    mon = CollapseMonitor(K, window=1)
    assert mon.update(0, {"loss": 1.0, "clip/acc_i2t": 0.5}) == []  # a CLIP-only run: nothing to watch
    fired = mon.update(1, {k: torch.tensor(v) for k, v in uniform_collapsed(1).items()})
    assert len(fired) == 1


def test_validation():
    with pytest.raises(ValueError, match="num_prototypes"):
        CollapseMonitor(1)
    with pytest.raises(ValueError, match="window"):
        CollapseMonitor(K, window=0)
    with pytest.raises(ValueError, match="usage_ratio"):
        CollapseMonitor(K, usage_ratio=0)


def test_nonfinite_advice_fits_the_objective(tmp_path):
    """The stop message names a checkpoint that exists (or says none does) and the setting that
    applies: the λs of an nCLIP head off λ1 = λ2 − 1 > 0, else the learning rate (CLIP has no λ)."""
    from nclip.config import resolve
    from nclip.train.checkpoint import checkpoint_dir
    from nclip.train.monitors import nonfinite_stop_message

    for objective, extra, fix in (("clip", [], "lower train.lr (now 0.002)"),
                                  ("xclip", [], "lower train.lr (now 0.002)"),
                                  ("xclip", ["objective.lambda1=0"], "objective.lambda1 = 0, objective.lambda2 = 1.5")):
        cfg = resolve("micro", [f"objective.name={objective}", *extra])
        text = nonfinite_stop_message(cfg, tmp_path, 3, 7)
        assert fix in text and "no checkpoint was written" in text and ("λ" in text) == bool(extra)
    ck = checkpoint_dir(tmp_path, 5)
    ck.mkdir(parents=True)
    (ck / "state.pt").write_bytes(b"")
    (ck / "model.safetensors").write_bytes(b"")
    assert f"the last good checkpoint is {ck} " in nonfinite_stop_message(cfg, tmp_path, 3, 7)
    mon = CollapseMonitor(K, lambda1=0.5, lambda2=1.5)
    warning = mon.update(1, {**healthy(1), "loss": float("nan")})[0]
    assert "lower train.lr" in warning and "λ1 = λ2 − 1" not in warning
