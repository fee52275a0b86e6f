"""The small conv-net image tower and hard-negative batches of synthetic scenes."""

import numpy as np
import pytest
import torch

from nclip.cli import main
from nclip.config import resolve
from nclip.data.loader import train_loader
from nclip.data.step_batches import StepBatches
from nclip.data.tokenization import CaptionTokenizer
from nclip.errors import NclipError
from nclip.models import build_model
from nclip.models.io import load_model, save_model

CONVNET = ["model.vision.kind=convnet", "model.vision.embedding_size=8", "model.vision.depths=[1,2]",
           "model.vision.hidden_sizes=[8,16]", "model.vision.heads=2"]


def test_convnet_tower_shapes_and_round_trip(tmp_path, micro_overrides):
    cfg = resolve("micro", micro_overrides + CONVNET)
    model = build_model(cfg, pretrained_text=False).eval()
    assert model.vision.kind == "convnet" and model.vision.width == 16
    ids, mask = model.tokenizer(["a red circle", "two blue squares", "a star"])
    pixels = torch.randn(3, 3, 16, 16)
    out = model(pixels, ids, mask)
    assert out.image_features.shape == (3, 16) and out.image["clip"].shape == (3, 32)
    # 16 px → 8 after the stride-2 stem → 4 after the second stage's pool: 16 positions + the mean
    assert model.vision.position.shape == (17, 16)
    save_model(model, cfg, tmp_path / "m")
    loaded, _ = load_model(tmp_path / "m")
    torch.testing.assert_close(loaded(pixels, ids, mask).image["clip"], out.image["clip"])


def test_convnet_feature_depends_on_where_things_are(micro_overrides):
    """Attention pooling with position embeddings: moving an object changes the feature (a
    global average pool of a translation-equivariant net would barely see it)."""
    cfg = resolve("micro", micro_overrides + CONVNET)
    tower = build_model(cfg, pretrained_text=False).eval().vision
    left, right = torch.zeros(1, 3, 16, 16), torch.zeros(1, 3, 16, 16)
    left[..., 4:8, 0:4], right[..., 4:8, 12:16] = 1.0, 1.0
    with torch.no_grad():
        assert (tower(left) - tower(right)).abs().max() > 1e-3


@pytest.mark.slow
def test_convnet_trains_and_export_refuses_it(tmp_path, micro_overrides, capsys):
    out = tmp_path / "run"
    args = ["train", "--preset", "micro", "--out", str(out), "--no-progress"]
    for o in micro_overrides + CONVNET + ["train.steps=4", "train.checkpoint_every=4"]:
        args += ["--set", o]
    assert main(args) == 0
    assert main(["export", "--checkpoint", str(out), "--hf", str(tmp_path / "hf")]) == 2
    assert "image tower 'convnet'" in capsys.readouterr().err


def test_convnet_attention_maps_are_the_weights_that_make_the_feature(micro_overrides):
    """Mask probing reads the pooling query's attention: rebuilding the feature from those maps
    (plus the weight the query puts on itself) must give the tower's own output."""
    cfg = resolve("micro", micro_overrides + CONVNET)
    tower = build_model(cfg, pretrained_text=False).eval().vision
    pixels = torch.randn(3, 3, 16, 16)
    maps = tower.attention_maps(pixels)
    assert maps.shape == (3, 2, 4, 4) and bool((maps >= 0).all()) and bool((maps.sum((2, 3)) < 1).all())
    with torch.no_grad():
        tokens, _ = tower._tokens(pixels)  # [B, 1 + 16, C]
        weights = torch.cat([1 - maps.sum((2, 3)).unsqueeze(-1), maps.flatten(2)], dim=2)  # [B, heads, 17]
        c = tower.width
        values = tokens @ tower.pool.in_proj_weight[2 * c:].T + tower.pool.in_proj_bias[2 * c:]
        values = values.view(3, 17, 2, c // 2).transpose(1, 2)  # [B, heads, 17, C / heads]
        mixed = (weights.unsqueeze(-1) * values).sum(2).flatten(1)  # [B, C]
        rebuilt = tower.norm(tower.pool.out_proj(mixed))
        torch.testing.assert_close(rebuilt, tower(pixels), atol=1e-5, rtol=1e-4)


def test_each_image_tower_says_whether_it_has_attention_maps():
    from nclip.models.towers import VISION_TOWERS

    assert {kind: cls.saliency for kind, cls in VISION_TOWERS.items()} == {
        "vit": "[CLS] attention", "resnet": None, "convnet": "attention-pool query attention",
        "clip_resnet": "attention-pool query attention", "groupvit": None}
    assert all(hasattr(cls, "attention_maps") == (cls.saliency is not None) for cls in VISION_TOWERS.values())


@pytest.mark.parametrize("override,message", [
    ("model.vision.heads=3", "convnet last width 16 is not divisible by heads 3"),
    ("model.vision.depths=[1]", "must be non-empty, positive and of the same length"),
])  # fmt: skip
def test_convnet_config_errors(micro_overrides, override, message):
    with pytest.raises(NclipError, match=message):
        resolve("micro", micro_overrides + CONVNET + [override])


def test_batches_keep_hard_negative_groups_whole():
    batches = StepBatches(length=1000, batch_size=32, steps=40, seed=1, group=4)
    seen = []
    for step in range(31):  # one epoch: 1000 // 32 steps
        idx = batches.global_batch(step)
        assert len(idx) == 32
        groups = idx.reshape(8, 4)
        assert (groups == groups[:, :1] + np.arange(4)).all() and (groups[:, 0] % 4 == 0).all()
        seen.extend(idx.tolist())
    assert len(set(seen)) == len(seen)  # no repeats within an epoch
    assert not np.array_equal(batches.global_batch(0), batches.global_batch(31))  # a new epoch
    # a rank's slice of a global batch is contiguous, so ranks together hold whole groups
    per_rank = [list(StepBatches(1000, 32, 1, 1, rank=r, world_size=2, group=4))[0] for r in range(2)]
    assert [i for _, i in per_rank[0] + per_rank[1]] == batches.global_batch(0).tolist()


def test_training_batches_are_whole_groups_of_the_grouped_scenes(micro_overrides):
    from nclip.data.sources import build_dataset

    cfg = resolve("micro", micro_overrides + ["data.hard_negative_group=4", "train.batch_size=8"])
    tokenizer = CaptionTokenizer(length=cfg.data.text_length)
    ids = next(iter(train_loader(cfg, tokenizer))).ids
    scenes = build_dataset(cfg, "train")
    assert scenes.hard_negative_group == 4
    idx = StepBatches(len(scenes), 8, cfg.train.steps, cfg.seed, group=4).global_batch(0)
    expected, _ = tokenizer([scenes[int(i)].caption for i in idx])
    assert torch.equal(ids, expected)
    assert build_dataset(cfg, "test", length=4).hard_negative_group == 1  # evaluation scenes are independent


@pytest.mark.parametrize("overrides,message", [
    (["data.hard_negative_group=3"], "train.batch_size 8 is not divisible by data.hard_negative_group 3"),
    (["data.source=digits", "data.hard_negative_group=2"], "needs data.source synthetic"),
])  # fmt: skip
def test_hard_negative_group_errors(micro_overrides, overrides, message):
    with pytest.raises(NclipError, match=message):
        resolve("micro", micro_overrides + overrides)


def test_convnet_refuses_images_of_another_size(micro_overrides):
    cfg = resolve("micro", micro_overrides + CONVNET)
    tower = build_model(cfg, pretrained_text=False).vision
    with pytest.raises(NclipError, match="built for 16 positions got images of 32x32 px"):
        tower(torch.zeros(1, 3, 32, 32))
