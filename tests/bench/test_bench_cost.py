"""What nclip bench costs besides its measurements: the hand loop trains on
the pixels the trainer trains on, no model is written, each model is built once, the evaluation
scenes are the same whatever the workers, and the stage estimates count builds and compilation.
(The whole bench's builds and bytes at --quick: tests/bench/test_bench.py.)"""

from __future__ import annotations

import math

import pytest
import torch
from bench_helpers import count_builds

from nclip.bench import context, loop_overhead, parts, stages
from nclip.bench.budget import ModelCosts
from nclip.bench.shared_models import ModelCache, model_key, shared_models
from nclip.config import resolve


def test_a_save_free_run_writes_its_config_and_metrics_only(tmp_path):
    from nclip.train.loop import train

    cfg = resolve("micro", ["train.steps=2", "train.checkpoint_every=1", "train.threads=1"])
    train(cfg, tmp_path / "run", progress=False, evaluate=True, save=False)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.yaml", "metrics.jsonl"]


def test_shared_models_build_once_per_model_config_and_hand_out_copies(monkeypatch):
    builds = count_builds(monkeypatch)
    cfg = resolve("micro", [])
    cache = ModelCache()
    first, second = cache.get(cfg), cache.get(cfg)
    assert len(builds) == 1 and cache.counts() == {"builds": 1, "copies": 2}
    assert first is not second and first.tokenizer is second.tokenizer
    with torch.no_grad():
        first.logit_scale.add_(1.0)  # a row trains its copy: the next copy starts from the build's weights
    third = cache.get(cfg)
    assert torch.equal(third.logit_scale, second.logit_scale) and not torch.equal(third.logit_scale, first.logit_scale)
    # the batch size is the row's; the checkpointing flag is another model
    assert cache.has(resolve("micro", ["train.batch_size=64"]))
    checkpointed = resolve("micro", ["model.grad_checkpointing=true"])
    assert not cache.has(checkpointed) and model_key(checkpointed) != model_key(cfg)
    cache.get(checkpointed)
    assert len(builds) == 2


def test_a_copy_is_the_model_a_build_makes_and_leaves_the_rng_as_a_build():
    from nclip.models import build_model

    cfg = resolve("micro", ["seed=3"])
    torch.manual_seed(cfg.seed)
    built = build_model(cfg)
    after_build = torch.rand(4)
    cache = ModelCache()
    cache.get(cfg)
    copy = cache.get(cfg)
    assert torch.equal(torch.rand(4), after_build)  # the objective built next draws the same numbers
    for (name, a), (_, b) in zip(built.state_dict().items(), copy.state_dict().items()):
        assert torch.equal(a, b), name


def test_train_gets_its_model_from_the_shared_models_block():
    import nclip.train.loop

    real = nclip.train.loop.build_model
    with shared_models() as cache:
        assert nclip.train.loop.build_model == cache.get
        with shared_models() as inner:
            assert inner is cache  # nested blocks share the outer cache
    assert nclip.train.loop.build_model is real


@pytest.mark.parametrize("preset", ["tiny", "cmsf-tiny"])
def test_the_hand_loop_trains_on_the_pixels_the_trainer_trains_on(preset):
    """uint8 pixels from the loader: the hand loop's feed normalises them on the device as the
    trainer's (DeviceFeed); two-view float pixels pass as they are. A conv-net step on raw uint8
    pixels fails ('expected scalar type Byte but found Float')."""
    from nclip.data.device_feed import DeviceFeed

    cfg = resolve(preset, ["train.batch_size=8", "train.threads=1"])
    batch = loop_overhead.one_batch(cfg)
    hand = loop_overhead.HandLoop(cfg, batch, warmup=1)  # made, then one warm-up step
    pixels = next(hand.feed).pixels
    expected = next(iter(DeviceFeed([batch], "cpu"))).pixels
    assert pixels.dtype == torch.float32 and torch.equal(pixels, expected)
    if batch.pixels.dtype == torch.uint8:
        assert not torch.equal(pixels, batch.pixels.float())  # normalised, not the raw values
    assert hand.window(1)[0] > 0


def test_the_scenes_are_the_same_whatever_the_workers():
    one = parts.scenes(24, 16, workers=1)
    two = parts.scenes(24, 16, workers=2)
    assert len(one) == len(two) == 24
    for a, b in zip(one, two):
        assert np_equal(a.image, b.image) and a.captions == b.captions and a.labels == b.labels
        assert a.masks is None and b.masks is None
    assert not np_equal(one[0].image, one[1].image)


def np_equal(a, b) -> bool:
    import numpy as np

    return a.shape == b.shape and bool(np.array_equal(a, b))


def _bench(compile_: bool = False) -> context.Bench:
    cfg = resolve("micro", [f"train.compile={str(compile_).lower()}"])
    b = context.Bench("micro", [], cfg, torch.device("cpu"), context.Sizes.pick(True, False), context.Budget(None),
                      lambda m: None)
    cost = {"step_s": 0.1, "build_s": 5.0, "copy_s": 0.5, "first_step_s": 1.0, "process_s": 8.0}
    b.costs = {"clip": cost, "xclip": cost}
    return b


def test_the_estimates_take_the_runs_step_at_the_least():
    b = _bench()  # micro: xclip
    b.costs = {"clip": {**b.costs["clip"], "step_s": 0.1}, "xclip": {**b.costs["xclip"], "step_s": 1.0}}
    assert b.step_costs().step_s == 1.0  # the run's objective, measured
    b.cfg = resolve("micro", ["objective.name=siglip"])
    assert b.step_costs().step_s == 0.1  # not measured: the cheaper of the two
    b.loop = {"trainer_step_s": 0.4}
    assert b.step_costs().step_s == 0.4  # the trainer row's, once measured


def test_the_estimates_count_builds_copies_and_compilation():
    c = ModelCosts(build_s=5.0, copy_s=0.5, compile_s=30.0, first_s=1.0, step_s=0.1)
    assert c.seconds(1, 2, 10, compiles=3) == pytest.approx(5 + 1 + 90 + 3 + 1)
    b = _bench()
    fresh = context.models_seconds(b, 2, 1)  # the loop row: a build and a copy
    # --compare open_clip: nclip's CLIP model is another config (a build), OpenCLIP's a build too
    assert stages._open_clip_estimate(b) == pytest.approx(2 * context.models_seconds(b, 1, 2, builds=1))
    b.models.templates[model_key(b.cfg)] = None  # the bench has built the run's model
    assert fresh - context.models_seconds(b, 2, 1) == pytest.approx(5.0 - 0.5)
    compiled = _bench(compile_=True)
    assert compiled.step_costs().compile_s == 60.0  # budget.COMPILE_GUESS_S until one is timed
    assert context.models_seconds(compiled, 2, 1) - fresh == pytest.approx(2 * 60.0)
    compiled.compile_s = 12.0
    assert context.models_seconds(compiled, 2, 1) - fresh == pytest.approx(2 * 12.0)
    # the memory rows on the CPU: the subprocess's start, two builds (plain, checkpointed), a copy per run
    memory = stages._memory_estimate(b)
    points, _ = stages._memory_points(b)
    assert memory >= 8.0 + 2 * 5.0 + (len(points) + 1) * 0.5 and math.isfinite(memory)


@pytest.mark.slow
def test_the_memory_points_build_one_model_per_model_config(monkeypatch):
    from nclip.bench import batch_memory as bm

    builds = count_builds(monkeypatch)
    points = [("none", 8, 1), ("grad checkpointing", 8, 1), ("exact accumulation", 16, 2), ("none", 16, 1)]
    measured = bm.measure("micro", ["train.threads=1"], points, warm=False)
    assert len(builds) == 2 and [p["batch"] for p in measured] == [8, 8, 16, 16]
    assert all(p["peak"] > 0 for p in measured)


@pytest.mark.slow
def test_the_trainer_row_builds_one_model_for_both_loops_in_a_shared_block(monkeypatch):
    builds = count_builds(monkeypatch)
    cfg = resolve("micro", ["train.threads=1"])
    with shared_models() as cache:
        out = loop_overhead.trainer_over_hand(cfg, repeats=2, window_s=0.01, warmup=1)
    assert len(builds) == 1 and cache.counts() == {"builds": 1, "copies": 2} and out["repeats"] == 2
