"""GroupViT's image tower (``model.vision.kind: groupvit``): its config, its feature, its grouping,
and training with the objectives that have an image tower."""

from __future__ import annotations

import json

import pytest
import torch

from nclip.cli import main
from nclip.config import resolve
from nclip.models import build_model
from nclip.models.groupvit_tower import patch_assignment
from nclip.models.locking import lock_tower

# two stages of one layer: 4 group tokens over the micro preset's 4x4 patches, kept by the last stage
GROUPVIT = ["model.vision.kind=groupvit", "model.vision.depths=[1,1]", "model.vision.group_tokens=[4,0]",
            "model.vision.output_groups=[4,4]"]


def test_groupvit_defaults_to_the_papers_stages(micro_overrides):
    cfg = resolve("micro", micro_overrides + ["model.vision.kind=groupvit"])
    v = cfg.model.vision
    assert (v.depths, v.group_tokens, v.output_groups) == ((6, 3, 3), (64, 8, 0), (64, 8, 8))


def test_feature_is_the_mean_of_the_last_groups(micro_overrides):
    torch.manual_seed(0)
    model = build_model(resolve("micro", micro_overrides + GROUPVIT), pretrained_text=False).eval()
    tower = model.vision
    assert tower.kind == "groupvit" and tower.width == 32
    pixels = torch.randn(3, 3, 16, 16)
    groups, assign = tower.groups(pixels)
    assert groups.shape == (3, 4, 32) and assign.shape == (3, 4, 4, 4)
    torch.testing.assert_close(tower(pixels), groups.mean(1))
    torch.testing.assert_close(assign.sum(1), torch.ones(3, 4, 4))  # each patch's share over the groups
    out = model.encode_image(pixels)
    assert out["features"].shape == (3, 32) and out["clip"].shape == (3, 32)


def test_patch_assignment_multiplies_the_stages():
    # 3 patches → 2 groups → 2 groups; hand-multiplied: patch p's share of group g is Σ_k a1[k, p]·a2[g, k]
    a1 = torch.tensor([[[1.0, 0.0, 0.5], [0.0, 1.0, 0.5]]])  # [1, 2 groups, 3 patches]
    a2 = torch.tensor([[[0.0, 1.0], [1.0, 0.0]]])  # [1, 2, 2]: stage 2 swaps the groups
    expected = torch.tensor([[[0.0, 1.0], [1.0, 0.0], [0.5, 0.5]]])  # [1, 3 patches, 2 groups]
    torch.testing.assert_close(patch_assignment([a1, a2]), expected)
    torch.testing.assert_close(patch_assignment([a1]), a1.transpose(1, 2))


def test_unlocked_layers_count_the_stages(micro_overrides):
    model = build_model(resolve("micro", micro_overrides + GROUPVIT + ["model.vision.unlocked_layers=1"]),
                        pretrained_text=False)
    lock_tower(model.vision, 1, "model.vision")
    stages = model.vision.model.vision_model.encoder.stages
    assert not any(p.requires_grad for p in stages[0].parameters())
    assert all(p.requires_grad for p in stages[1].parameters())
    assert all(p.requires_grad for p in model.vision.model.vision_model.layernorm.parameters())


@pytest.mark.parametrize("override,needle", [
    ("model.vision.depths=[1]", "need one entry per stage"),
    ("model.vision.group_tokens=[0,0]", "must be positive (the last may be 0)"),
    ("model.vision.output_groups=[4,2]", "keeps its groups"),
    ("model.vision.heads=3", "not divisible by heads 3"),
    ("model.vision.patch_size=3", "not divisible by model.vision.patch_size 3"),
])  # fmt: skip
def test_bad_groupvit_sizes_are_one_line(tmp_path, capsys, override, needle):
    argv = ["train", "--preset", "micro", "--out", str(tmp_path / "r")]
    for o in GROUPVIT + [override]:
        argv += ["--set", o]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_group_sizes_need_groupvit(tmp_path, capsys):
    assert main(["train", "--preset", "micro", "--out", str(tmp_path / "r"),
                 "--set", "model.vision.group_tokens=[4,0]"]) == 2
    err = capsys.readouterr().err.strip()
    assert "group_tokens and output_groups need kind groupvit (got vit)" in err and len(err.splitlines()) == 1


def _drop_path_tower(micro_overrides, rate: float):
    torch.manual_seed(0)
    cfg = resolve("micro", micro_overrides + GROUPVIT + [f"model.vision.drop_path_rate={rate}"])
    return build_model(cfg, pretrained_text=False).vision


def test_drop_path_drops_each_layers_branches_at_groupvits_rates(micro_overrides):
    """drop_path_rate 0.5 over the 2 stage layers: GroupViT's linspace(0, 0.5, 2) = 0, 0.5. A layer
    in training equals its residual block with each sample's attention and MLP branch kept with
    probability 1 − rate and scaled by 1/(1 − rate), drawn in that order; in eval it drops nothing."""
    tower = _drop_path_tower(micro_overrides, 0.5)
    assert tower.drop_path == ("0.5 (linear 0 to 0.5 over 2 blocks, per transformer layer of every stage, attention "
                               "and MLP branches)")
    layers = [stage.layers[0] for stage in tower.model.vision_model.encoder.stages]
    x = torch.randn(256, 5, 32)
    with torch.no_grad():
        for layer, rate in zip(layers, (0.0, 0.5)):
            tower.train()
            torch.manual_seed(7)
            got = layer(x, attention_mask=None)
            torch.manual_seed(7)
            keep = [torch.ones(256, 1, 1)] * 2 if rate == 0 else [x.new_empty(256, 1, 1).bernoulli_(0.5) / 0.5
                                                                   for _ in range(2)]
            tower.eval()  # the branches undropped (the layers have no dropout of their own)
            h = x + layer.self_attn(layer.layer_norm1(x))[0] * keep[0]
            torch.testing.assert_close(got, h + layer.mlp(layer.layer_norm2(h)) * keep[1])
            plain = x + layer.self_attn(layer.layer_norm1(x))[0]
            plain = plain + layer.mlp(layer.layer_norm2(plain))
            torch.testing.assert_close(layer(x, attention_mask=None), plain)  # eval: nothing dropped
        assert 0.3 < float((keep[0] == 0).float().mean()) < 0.7  # the second layer dropped about half


def test_drop_path_keeps_the_weights_and_their_names(micro_overrides):
    with_drop, without = _drop_path_tower(micro_overrides, 0.1), _drop_path_tower(micro_overrides, 0.0)
    a, b = with_drop.state_dict(), without.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # same init, same checkpoint layout
    pixels = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(with_drop.eval()(pixels), without.eval()(pixels))
    assert without.drop_path == "none (drop_path 0)"


def test_a_second_drop_path_replaces_the_first(micro_overrides):
    from nclip.models.drop_path import add_drop_path

    tower = _drop_path_tower(micro_overrides, 0.1)  # the pre-training's rate; fine-tuning sets its own
    layer = tower.model.vision_model.encoder.stages[1].layers[0]
    assert len(layer.self_attn._forward_hooks) == 1 and len(layer.mlp._forward_hooks) == 1
    add_drop_path(tower, 0.2)
    assert len(layer.self_attn._forward_hooks) == 1 and len(tower._drop_path_hooks) == 4
    add_drop_path(tower, 0.0)
    assert not layer.self_attn._forward_hooks and not layer.mlp._forward_hooks


def test_drop_path_needs_groupvit(tmp_path, capsys):
    assert main(["train", "--preset", "micro", "--out", str(tmp_path / "r"),
                 "--set", "model.vision.drop_path_rate=0.1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "drop_path_rate needs kind groupvit (got vit)" in err and len(err.splitlines()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["xclip", "clip"])
def test_groupvit_trains_two_steps(tmp_path, objective):
    argv = ["train", "--preset", "micro", "--out", str(tmp_path / "run")]
    for o in GROUPVIT + [f"objective.name={objective}", "train.steps=2", "train.batch_size=8", "train.warmup_steps=1",
                         "train.log_every=1", "train.checkpoint_every=2", "eval.samples=32", "eval.batch_size=32"]:
        argv += ["--set", o]
    assert main(argv) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


def test_paper_scale_preset_shows_its_config(capsys):
    assert main(["config", "--preset", "groupvit-s-xclip"]) == 0
    out = capsys.readouterr().out
    assert "kind: groupvit" in out and "lr: 0.0005" in out
    cfg = resolve("groupvit-s-xclip")  # GroupViT's recipe where the config can hold it (configs/default.yml)
    t, aug = cfg.train, cfg.data.augment
    assert (t.betas, t.eps, t.grad_clip, t.min_lr, t.weight_decay) == ((0.9, 0.999), 1e-8, 5.0, 4e-5, 0.05)
    assert cfg.model.vision.drop_path_rate == 0.1 and aug.crop_scale == (0.08, 1.0) and aug.horizontal_flip
    assert t.steps == round(35e6 * 30 / 4096) and t.warmup_steps == round(35e6 * 2 / 4096)  # IT35M, 30 and 2 epochs
