"""The bench's loader row: the generator's per-core rate over the real loader's per-worker rate on
the same config (figures are not asserted: only that both sides were measured)."""

import math

from nclip.bench.loader_rate import BATCH, loader_over_generator
from nclip.config import resolve

from conftest import micro_sizes


def test_loader_over_generator_measures_both_sides_on_one_config():
    cfg = resolve("micro", [*micro_sizes(), "data.source=digits"])
    out = loader_over_generator(cfg, 16, workers=1)
    assert out["workers"] == 1 and out["samples"] == out["batch_size"] == BATCH  # one batch after the first
    for key in ("ratio", "generator_samples_per_s_per_core", "samples_per_s_per_worker", "wall_samples_per_s"):
        assert math.isfinite(out[key]) and out[key] > 0, key
