"""Pixels travel as uint8 and are normalised where the step runs: the same floats as the old float
path; two views travel as uint8 crops and are finished by the feed; the device feed passes the
source's position through (also when it reads ahead), measures the data wait, and keeps errors at
their step; data.num_workers auto is 0 on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from nclip.batch import Batch
from nclip.config import resolve
from nclip.data.device_feed import DeviceFeed
from nclip.data.loader import _AUG_STREAM, train_loader
from nclip.data.sources import build_dataset
from nclip.data.tokenization import CaptionTokenizer
from nclip.data.transforms import augment, normalize_pixels, random_resized_crop, to_tensor, to_uint8_tensor
from nclip.data.views import ViewCrops, finish_views
from nclip.data.workers import AUTO_WORKERS_CAP, init_worker, loader_options, loader_workers
from nclip.errors import NclipError

from conftest import micro_sizes

JITTER = ["data.augment.color_jitter_prob=0.5", "data.augment.grayscale_prob=0.3", "data.augment.crop_scale=[0.5,1.0]"]


def _cfg(*extra):
    return resolve("micro", [*micro_sizes(), "train.batch_size=8", "train.steps=4", *extra])


@pytest.fixture(scope="module")
def tokenizer():
    return CaptionTokenizer(16)


def test_normalised_uint8_is_bitwise_the_float_path():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (5, 23, 31, 3), dtype=np.uint8)
    old = torch.stack([to_tensor(im) for im in images])
    new = normalize_pixels(torch.stack([to_uint8_tensor(im) for im in images]))
    assert new.dtype == torch.float32 and torch.equal(new, old)


def test_a_full_size_crop_is_the_image_itself():
    image = np.random.default_rng(1).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    crop = random_resized_crop(image, 16, (1.0, 1.0), (1.0, 1.0), np.random.default_rng(2))
    via_pillow = np.asarray(Image.fromarray(image).resize((16, 16), Image.BILINEAR, box=(0, 0, 16, 16)))
    assert np.array_equal(crop, via_pillow)


def test_loader_pixels_are_uint8_and_normalise_to_the_old_floats(tokenizer):
    """The colour augmentations round to uint8 themselves: no pixel changes, jitter or not."""
    cfg = _cfg(*JITTER)
    batch = next(iter(train_loader(cfg, tokenizer)))
    pixels = batch.pixels
    assert batch.labels is None and batch.index is None  # xCLIP asks for no per-row tensors
    assert pixels.dtype == torch.uint8 and pixels.shape == (8, 3, cfg.data.image_size, cfg.data.image_size)
    samples = build_dataset(cfg, "train")
    keys = train_loader(cfg, tokenizer).loader.batch_sampler.global_batch(0)
    old = torch.stack([to_tensor(augment(samples[int(i)].image, cfg.data.image_size, cfg.data.augment,
                                         np.random.default_rng([cfg.seed, _AUG_STREAM, int(i)]))) for i in keys])
    assert torch.equal(normalize_pixels(pixels), old)


def test_feed_on_the_cpu_normalises_and_passes_the_rest_through(tokenizer):
    cfg = _cfg(*JITTER)
    plain = list(train_loader(cfg, tokenizer))
    feed = DeviceFeed(train_loader(cfg, tokenizer), "cpu")
    fed = list(feed)
    assert len(fed) == len(plain) == len(feed) == 4 and feed.size == cfg.data.train_length
    for p, f in zip(plain, fed):
        assert f.pixels.dtype == torch.float32 and torch.equal(f.pixels, normalize_pixels(p.pixels))
        assert torch.equal(f.ids, p.ids) and torch.equal(f.mask, p.mask)
    waited, steps = feed.pop_wait()
    assert steps == 4 and waited >= 0 and feed.pop_wait() == (0.0, 0)


def test_two_views_travel_as_uint8_crops_and_the_feed_finishes_them(tokenizer):
    """For a device the loader ships ViewCrops (uint8 crops, colour parameters); the feed's views
    are bitwise those the loader finishes itself without a device (what direct consumers get), also
    through a worker process."""
    cfg = _cfg()
    raw = next(iter(train_loader(cfg, tokenizer, views=2, device="cpu")))
    crops = raw.pixels
    assert isinstance(crops, ViewCrops) and crops.pixels.dtype == torch.uint8
    assert crops.pixels.shape == (8, 2, 3, cfg.data.image_size, cfg.data.image_size)
    plain = list(train_loader(cfg, tokenizer, views=2))
    fed = list(DeviceFeed(train_loader(cfg, tokenizer, views=2, device="cpu"), "cpu"))
    assert len(fed) == len(plain) == 4
    for p, f in zip(plain, fed):
        assert p.pixels.dtype == torch.float32 and p.pixels.shape[1] == 2
        assert all(torch.equal(a, b) for a, b in zip(p.tensors(), f.tensors()))
    assert torch.equal(plain[0].pixels, finish_views(crops))
    worker = list(train_loader(_cfg("data.num_workers=1"), tokenizer, views=2, device="cpu"))
    assert isinstance(worker[0].pixels, ViewCrops) and worker[0].pixels.order == crops.order
    assert torch.equal(worker[0].pixels.pixels, crops.pixels) and torch.equal(worker[0].pixels.params, crops.params)


def test_pinning_keeps_the_crops_whole(tokenizer, monkeypatch):
    """On CUDA the DataLoader pins every batch (pin_memory=True) before the feed sees it: a
    ViewCrops comes out a ViewCrops, its tensors pinned, its order and recipe as they were (no CUDA
    here: pinning is replaced by a copy that records what it was asked for)."""
    from torch.utils.data._utils.pin_memory import pin_memory

    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a: pinned.append(self.shape) or self.clone())
    batch = next(iter(train_loader(_cfg(), tokenizer, views=2, device="cpu")))
    crops, sent = pin_memory(batch).pixels, batch.pixels
    assert isinstance(crops, ViewCrops) and crops.order == sent.order and crops.recipe == sent.recipe
    assert torch.equal(crops.pixels, sent.pixels) and torch.equal(crops.params, sent.params)
    assert sent.pixels.shape in pinned and sent.params.shape in pinned and batch.ids.shape in pinned


class _Counting:
    """A source whose position moves with every batch read, and which may fail at one batch."""

    lookahead = True

    def __init__(self, n: int, fail_at: int | None = None):
        self.n, self.fail_at, self.read = n, fail_at, 0

    @property
    def skipped(self) -> int:
        return 10 * self.read

    def state(self) -> dict:
        return {"kind": "map", "skipped": self.skipped}

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        for b in range(self.n):
            if b == self.fail_at:
                raise NclipError("bad batch")
            self.read += 1
            ids = torch.zeros(2, 5, dtype=torch.long)
            yield Batch(torch.full((2, 3, 4, 4), b, dtype=torch.uint8), ids, ids)


@pytest.mark.parametrize("lookahead", [True, False])
def test_state_and_skipped_are_those_after_the_batch_handed_out(lookahead):
    source = _Counting(4)
    feed = DeviceFeed(source, "cpu", lookahead=lookahead)
    assert feed.state() == {"kind": "map", "skipped": 0}
    for b, batch in enumerate(feed):
        pixels = batch.pixels
        assert source.read == (min(b + 2, 4) if lookahead else b + 1)  # reading ahead, or not
        assert feed.skipped == 10 * (b + 1) and feed.state() == {"kind": "map", "skipped": 10 * (b + 1)}
        assert torch.equal(pixels, normalize_pixels(torch.full((2, 3, 4, 4), b, dtype=torch.uint8)))


def test_an_error_read_ahead_is_raised_at_its_own_step():
    got = []
    with pytest.raises(NclipError, match="bad batch"):
        for batch in DeviceFeed(_Counting(4, fail_at=2), "cpu"):
            got.append(int(batch.pixels[0, 0, 0, 0].round()))
    assert len(got) == 2  # batches 0 and 1 were handed out before the error


def test_a_source_without_lookahead_is_not_read_ahead():
    class Plain(_Counting):
        lookahead = False

    assert DeviceFeed(Plain(2), "cpu").lookahead is False
    assert DeviceFeed(_Counting(2), "cpu").lookahead is True


def test_num_workers_auto_is_0_on_the_cpu_and_explicit_values_stay(monkeypatch):
    cfg = _cfg()
    assert cfg.data.num_workers is None and loader_workers(cfg) == 0 and loader_workers(cfg, "cpu") == 0
    assert loader_workers(_cfg("data.num_workers=3"), "cuda") == 3
    options = loader_options(0, "cpu", seed=5)
    assert options.pop("generator").initial_seed() == 5  # the workers' seeds: not from the global RNG
    assert options == {"num_workers": 0, "pin_memory": False}
    options = loader_options(2, "cuda")
    options.pop("generator")
    assert options == {"num_workers": 2, "pin_memory": True, "persistent_workers": True, "prefetch_factor": 2,
                       "worker_init_fn": init_worker}
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(32)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert loader_workers(cfg, "cuda") == AUTO_WORKERS_CAP
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert loader_workers(cfg, "cuda") == 3  # 32 cores / 8 ranks, one left to the rank itself
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert loader_workers(cfg, "cuda") == 1  # at least one


def test_a_bad_worker_count_is_a_one_line_config_error():
    with pytest.raises(NclipError) as e:
        _cfg("data.num_workers=-1")
    assert "data.num_workers" in str(e.value) and len(str(e.value).splitlines()) == 1


def test_a_worker_gives_the_in_process_batches(tokenizer):
    cfg = _cfg(*JITTER)
    here = list(train_loader(cfg, tokenizer))
    worker = list(train_loader(_cfg(*JITTER, "data.num_workers=1"), tokenizer))
    assert all(torch.equal(a, b) for x, y in zip(here, worker) for a, b in zip(x.tensors(), y.tensors()))
    assert len(worker) == 4


def test_the_epoch_permutation_kept_between_steps_changes_no_batch():
    from nclip.data.step_batches import StepBatches

    steps = [0, 1, 9, 10, 3, 25, 2]  # epochs of 8 steps, visited out of order
    kept = StepBatches(64, 8, 40, seed=3)
    for step in steps:
        assert np.array_equal(kept.global_batch(step), StepBatches(64, 8, 40, seed=3).global_batch(step))
