"""nclip bench's largest-batch and patch-dropout rows: the fit and the limit on synthetic memory,
(their values in a --quick run: tests/bench/test_bench.py; no wall-clock assertions)."""

from __future__ import annotations

import pytest

from nclip.bench import batch_memory as bm
from nclip.bench import context, stages

MIB, GIB = 2**20, 2**30


def test_the_fit_is_exact_on_linear_memory():
    xs = [16, 64, 256]
    fit = bm.fit_line(xs, [3 * GIB + 5 * MIB * x for x in xs])
    assert fit["a"] == pytest.approx(3 * GIB) and fit["b"] == pytest.approx(5 * MIB)
    assert fit["residual"] == pytest.approx(0, abs=1e-12)


def test_the_residual_says_how_far_a_point_lies_from_the_line():
    fit = bm.fit_line([1, 2, 3], [10.0, 30.0, 30.0])
    assert fit["residual"] > 0.1


def test_one_batch_size_is_no_line():
    with pytest.raises(ValueError, match="two distinct"):
        bm.fit_line([8, 8], [1.0, 2.0])


def test_the_largest_batch_is_the_last_that_fits():
    assert bm.largest_batch(2 * GIB, MIB, 3 * GIB) == 1024
    assert bm.largest_batch(2 * GIB, MIB, 3 * GIB - 1) == 1023
    assert bm.largest_batch(2 * GIB, MIB, 3 * GIB, multiple=100) == 1000
    assert bm.largest_batch(4 * GIB, MIB, 3 * GIB) == 0  # not even one row
    assert bm.largest_batch(GIB, 0.0, 3 * GIB) is None  # flat memory bounds nothing


def _synthetic(per_row: dict, fixed: float, m0: int, heads_row: float) -> list[dict]:
    """Points of :func:`bm.measure`'s form from linear memory: plain/checkpointed a + b·B, exact
    accumulation a + towers·m0 + heads·B."""
    points = bm.plan((32, 64, 128), m0, (2, 4, 8))
    out = []
    for setting, n, k in points:
        if setting == "exact accumulation":
            peak = fixed + (per_row["none"] - heads_row) * m0 + heads_row * n
        else:
            peak = fixed + per_row[setting] * n
        out.append({"setting": setting, "batch": n, "k": k, "peak": peak})
    return out


def test_largest_batches_are_ordered_on_synthetic_memory():
    measured = _synthetic({"none": 4 * MIB, "grad checkpointing": 1.5 * MIB}, GIB, m0=16, heads_row=0.5 * MIB)
    fits = bm.largest_batches(measured, 16, 9 * GIB)
    none, ckpt, exact = (fits[s] for s in ("none", "grad checkpointing", "exact accumulation"))
    assert none["batch"] == 2048 and none["b"] == pytest.approx(4 * MIB) and none["a"] == pytest.approx(GIB)
    assert ckpt["batch"] >= none["batch"]
    assert exact["micro"] == 512 and exact["batch"] % 512 == 0 and exact["batch"] > none["batch"]
    assert exact["per_sample"] == pytest.approx(0.5 * MIB) and exact["tower_per_sample"] == pytest.approx(3.5 * MIB)
    # the exact figure is the largest multiple of the micro-batch under the limit
    peak = lambda n: GIB + 3.5 * MIB * 512 + 0.5 * MIB * n  # noqa: E731
    assert peak(exact["batch"]) <= 9 * GIB < peak(exact["batch"] + 512)
    assert all(f["residual"] == pytest.approx(0, abs=1e-9) for f in fits.values())


def test_the_points_run_the_setting_on():
    cfg = bm.point_config("micro", [], "grad checkpointing", 64, 1)
    assert cfg.model.grad_checkpointing and cfg.train.batch_size == 64
    cfg = bm.point_config("micro", [], "exact accumulation", 64, 4)
    assert cfg.train.accumulation == 4 and cfg.train.accumulation_mode == "exact"


def test_the_patch_dropout_rows_say_why_on_a_convnet():
    from nclip.config import resolve

    cfg = resolve("tiny", [])
    assert cfg.model.vision.kind != "vit"
    b = context.Bench("tiny", [], cfg, None, context.Sizes.pick(True, False), context.Budget(None), lambda m: None)
    stage = next(s for s in stages.STAGES if s.name == "patch_dropout")
    assert stage.estimate(b) == 0.0  # skipped at once: the budget never skips it for want of time
    stages._stage_patch_dropout(b)
    assert [r.what for r in b.rep.rows] == list(stages.PATCH_ROWS)
    assert all(r.value is None and r.detail.startswith("skipped: patch dropout needs a ViT tower") for r in b.rep.rows)
