"""CLIP's modified ResNet image tower (model.vision.kind: clip_resnet; issue 27.3): RN50's size and
shapes, the paper's three changes, attention pooling and mask probing through it, config errors."""

import pytest
import torch
from torch import nn

from nclip.config import VisionConfig, resolve
from nclip.errors import NclipError
from nclip.models import build_model
from nclip.models.clip_resnet import Bottleneck, ClipResNetTower
from nclip.models.io import load_model, save_model

RN50 = VisionConfig(kind="clip_resnet", embedding_size=64, depths=(3, 4, 6, 3),
                    hidden_sizes=(256, 512, 1024, 2048), heads=32, pool_dim=1024)
SMALL = ["model.vision.kind=clip_resnet", "model.vision.embedding_size=8", "model.vision.depths=[1,2]",
         "model.vision.hidden_sizes=[16,32]", "model.vision.heads=2", "model.vision.pool_dim=24"]


def _rn50_parameters(width=64, depths=(3, 4, 6, 3), heads_dim=2048, grid=7, out=1024) -> int:
    """CLIP's RN50 image tower counted from its description, independently of the module: convolutions
    without bias, BatchNorm γ and β per channel, a 1×1 projection in the first block of every stage,
    the pool's position embedding (grid² + 1 rows), q/k/v (C×C + C each) and output projection."""
    def conv(c_in, c_out, k=1):
        return c_in * c_out * k * k + 2 * c_out  # with its BatchNorm

    n = conv(3, width // 2, 3) + conv(width // 2, width // 2, 3) + conv(width // 2, width, 3)
    c_in = width
    for s, depth in enumerate(depths):
        mid = width * 2**s
        for i in range(depth):
            n += conv(c_in, mid) + conv(mid, mid, 3) + conv(mid, 4 * mid)
            if i == 0:
                n += conv(c_in, 4 * mid)  # the (average-pooled) shortcut projection
            c_in = 4 * mid
    return n + (grid * grid + 1) * heads_dim + 3 * (heads_dim * heads_dim + heads_dim) + heads_dim * out + out


@pytest.fixture(scope="module")
def rn50():
    return ClipResNetTower(RN50, 224)  # built once: about a second of initialisation


def test_rn50_has_clips_parameter_count_and_shapes(rn50):
    """CLIP's paper (Radford et al. 2021, its CLIP-ResNet hyperparameters, Tab. 19) gives RN50 as
    ResNet blocks (3, 4, 6, 3), width 2048 at the last stage, embedding dimension 1024, 224 px input,
    and Sec. 2.4 its three changes; it states no parameter count. The count is 38,316,896: computed
    here from that description (32 pooling heads, as the released model: 2048 / 64), and the size of
    OpenAI's released RN50 image tower (38.3M parameters: 153 MB as float32 in its ONNX exports,
    76.6 MB as float16)."""
    tower = rn50
    count = sum(p.numel() for p in tower.parameters())
    assert count == _rn50_parameters() == 38_316_896
    assert tower.width == 1024 and tower.pool.heads == 32
    assert tower.pool.position.shape == (7 * 7 + 1, 2048)  # 224 px / 32
    assert [len(stage) for stage in tower.stages] == [3, 4, 6, 3]
    assert [stage[-1].branch[-1].num_features for stage in tower.stages] == [256, 512, 1024, 2048]


def test_stage_resolutions_at_224_px():
    """RN50's maps (narrow channels for speed): stem 56 px, stages 56, 28, 14, 7; the feature [B, pool_dim]."""
    cfg = VisionConfig(kind="clip_resnet", embedding_size=8, depths=(1, 1, 1, 1), hidden_sizes=(8, 8, 8, 16),
                       heads=2, pool_dim=12)
    tower = ClipResNetTower(cfg, 224).eval()
    sides = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: sides.append(tuple(out.shape[1:])))
             for m in (tower.stem, *tower.stages)]
    with torch.no_grad():
        feature = tower(torch.randn(2, 3, 224, 224))
    for h in hooks:
        h.remove()
    assert sides == [(8, 56, 56), (8, 56, 56), (8, 28, 28), (8, 14, 14), (16, 7, 7)]
    assert feature.shape == (2, 12)


def test_the_papers_three_changes(rn50):
    tower = rn50
    # 1. three 3x3 convolutions (w/2, w/2, w; the first of stride 2) and an average pool, no max pool
    stem_convs = [m for m in tower.stem if isinstance(m, nn.Conv2d)]
    assert [(c.kernel_size, c.stride, c.out_channels) for c in stem_convs] == [
        ((3, 3), (2, 2), 32), ((3, 3), (1, 1), 32), ((3, 3), (1, 1), 64)]
    assert isinstance(tower.stem[-1], nn.AvgPool2d)
    assert not any(isinstance(m, nn.MaxPool2d) for m in tower.modules())
    # 2. anti-aliased strides: the only strided convolution is the stem's first; a block that halves
    #    the map average-pools before its last 1x1 convolution and before its shortcut's projection
    strided = [m for m in tower.modules() if isinstance(m, nn.Conv2d) and m.stride != (1, 1)]
    assert strided == stem_convs[:1]
    for s, stage in enumerate(tower.stages):
        first = stage[0]
        pools = [type(m) for m in first.branch]
        if s == 0:
            assert nn.AvgPool2d not in pools and isinstance(first.shortcut[0], nn.Conv2d)
        else:
            assert pools[-3:] == [nn.AvgPool2d, nn.Conv2d, nn.BatchNorm2d] and first.branch[-3].kernel_size == 2
            assert isinstance(first.shortcut[0], nn.AvgPool2d) and isinstance(first.shortcut[1], nn.Conv2d)
        assert all(isinstance(b.shortcut, nn.Identity) for b in stage[1:])
    # each block starts as its shortcut (the last BatchNorm's γ = 0)
    assert not any(b.branch[-1].weight.any() for b in tower.modules() if isinstance(b, Bottleneck))


def test_dual_encoder_shapes_and_round_trip(tmp_path, micro_overrides):
    cfg = resolve("micro", micro_overrides + SMALL)
    model = build_model(cfg, pretrained_text=False).eval()
    assert model.vision.kind == "clip_resnet" and model.vision.width == 24
    ids, mask = model.tokenizer(["a red circle", "two blue squares", "a star"])
    pixels = torch.randn(3, 3, 16, 16)
    out = model(pixels, ids, mask)
    assert out.image_features.shape == (3, 24) and out.image["clip"].shape == (3, 32)
    # 16 px → 8 (stride-2 conv) → 4 (stem pool) → 2 (second stage): 4 positions + the mean token
    assert model.vision.pool.position.shape == (5, 32)
    save_model(model, cfg, tmp_path / "m")
    loaded, _ = load_model(tmp_path / "m")
    torch.testing.assert_close(loaded(pixels, ids, mask).image["clip"], out.image["clip"])


def test_attention_maps_are_the_weights_that_make_the_feature(micro_overrides):
    """Mask probing reads the pool's query attention: the feature rebuilt from those maps (plus the
    weight on the mean token) is the tower's own output."""
    torch.manual_seed(0)
    tower = build_model(resolve("micro", micro_overrides + SMALL), pretrained_text=False).eval().vision
    pixels = torch.randn(3, 3, 16, 16)
    maps = tower.attention_maps(pixels)
    assert maps.shape == (3, 2, 2, 2) and bool((maps >= 0).all()) and bool((maps.sum((2, 3)) < 1).all())
    with torch.no_grad():
        fmap = tower._body(pixels)
        grid = fmap.flatten(2).transpose(1, 2)
        tokens = torch.cat([grid.mean(1, keepdim=True), grid], 1) + tower.pool.position  # [B, 5, C]
        values = tower.pool.value(tokens).view(3, 5, 2, 16).transpose(1, 2)  # [B, heads, 5, C / heads]
        weights = torch.cat([1 - maps.sum((2, 3)).unsqueeze(-1), maps.flatten(2)], dim=2)  # [B, heads, 5]
        rebuilt = tower.pool.proj((weights.unsqueeze(-1) * values).sum(2).flatten(1))
        torch.testing.assert_close(rebuilt, tower(pixels), atol=1e-5, rtol=1e-4)


def test_mask_probing_runs_through_the_attention_pool(micro_overrides):
    from nclip.data.sources import build_dataset
    from nclip.eval import masks

    assert masks.unsupported("clip_resnet") is None
    cfg = resolve("micro", micro_overrides + SMALL)
    model = build_model(cfg, pretrained_text=False)
    f = masks.extract(model, build_dataset(cfg, "test", length=4), cfg.data.image_size, "cpu")
    assert f["attn"].shape == (4, 2, 2, 2) and f["masks"].shape == (4, 16, 16)
    r = masks.evaluate(f["attn"], f["masks"], ignore=f["ignore"])
    assert 0.0 <= r["jaccard"] <= 1.0 and r["best_head"] in (0, 1)


def test_refuses_images_of_another_size(micro_overrides):
    tower = build_model(resolve("micro", micro_overrides + SMALL), pretrained_text=False).vision
    with pytest.raises(NclipError, match="built for 4 positions got a 4x4 feature map"):
        tower(torch.zeros(1, 3, 32, 32))


@pytest.mark.parametrize("overrides,message", [
    (["model.vision.heads=5"], "clip_resnet last width 32 is not divisible by heads 5"),
    (["model.vision.hidden_sizes=[16,30]"], "must be multiples of 4"),
    (["model.vision.embedding_size=9"], "embedding_size 9 must be even"),
    (["model.vision.depths=[1]"], "must be non-empty, positive and of the same length"),
    (["model.vision.pool_dim=0"], "model.vision.pool_dim"),
    (["model.vision.pool_size=3"], "model.vision.pool_size: unknown key"),
    (["model.vision.depths=[1,1,1,1]", "model.vision.hidden_sizes=[16,16,16,32]"],
     "data.image_size 16 is too small for a clip_resnet of 4 stages (at least 31 px)"),
])  # fmt: skip
def test_config_errors_are_one_line(micro_overrides, overrides, message):
    with pytest.raises(NclipError) as e:
        resolve("micro", micro_overrides + SMALL + overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_pool_dim_needs_clip_resnet(micro_overrides):
    with pytest.raises(NclipError, match="pool_dim needs kind clip_resnet"):
        resolve("micro", micro_overrides + ["model.vision.pool_dim=16"])
