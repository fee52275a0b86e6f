"""The bench's loader rows: the generator's per-core rate over the real loader's per-worker rate on
the same config, and the loader's per-worker rate with one view over two views (figures are not
asserted: only that both sides were measured, on what)."""

import math

from nclip.bench.loader_rate import BATCH, VIEWS_SIZE, loader_over_generator, views_over_one
from nclip.config import resolve

from conftest import micro_sizes


def test_loader_over_generator_measures_both_sides_on_one_config():
    cfg = resolve("micro", [*micro_sizes(), "data.source=digits"])
    out = loader_over_generator(cfg, 16, workers=1)
    assert out["workers"] == 1 and out["samples"] == out["batch_size"] == BATCH  # one batch after the first
    for key in ("ratio", "generator_samples_per_s_per_core", "samples_per_s_per_worker", "wall_samples_per_s"):
        assert math.isfinite(out[key]) and out[key] > 0, key


def test_views_over_one_measures_both_loaders_at_224_px_with_crops_for_the_device():
    """The two-view side counts the workers' part (uint8 crops, colour parameters): its batches are
    the trainer's, for a device; both sides on one data config, at 224 px."""
    from unittest import mock

    import nclip.data.loader as loader_mod

    seen = []
    real = loader_mod.train_loader

    def spy(cfg, tokenizer, **kw):
        seen.append((cfg.data.image_size, cfg.data.source, kw.get("views"), kw.get("device")))
        return real(cfg, tokenizer, **kw)

    cfg = resolve("micro", [*micro_sizes(), "data.source=digits"])
    with mock.patch.object(loader_mod, "train_loader", spy):
        out = views_over_one(cfg, 16, workers=1)
    assert {s[2] for s in seen} == {1, 2} and {s[:2] for s in seen} == {(VIEWS_SIZE, "digits")}
    assert {s[3] for s in seen} == {"cpu"}  # for a device: two views stay uint8 crops in the workers
    assert out["image_size"] == VIEWS_SIZE == 224
    for side in ("one_view", "two_views"):
        assert out[side]["samples"] == BATCH and math.isfinite(out[side]["samples_per_s_per_worker"])
    assert out["ratio"] == out["one_view"]["samples_per_s_per_worker"] / out["two_views"]["samples_per_s_per_worker"]
