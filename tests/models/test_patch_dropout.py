"""model.vision.patch_dropout (FLIP) and train.unmasked_steps."""

import pytest
import torch

from nclip.config import VisionConfig, resolve
from nclip.errors import NclipError
from nclip.models import build_model
from nclip.models.patch_dropout import kept_patches, patch_dropout_at, set_patch_dropout
from nclip.models.towers import VisionTower, vision_config


def _tower(p: float = 0.0) -> VisionTower:
    torch.manual_seed(0)  # 16 px, patch 4: N = 16 patch tokens
    return VisionTower(vision_config(VisionConfig(width=32, layers=2, heads=2, patch_size=4), 16), patch_dropout=p)


def _tokens_seen(tower: VisionTower, pixels: torch.Tensor) -> tuple[torch.Tensor, int]:
    seen = []
    hook = tower.model.encoder.register_forward_hook(lambda m, args, kw, out: seen.append(kw["inputs_embeds"].shape[1]),
                                                      with_kwargs=True)
    out = tower(pixels)
    hook.remove()
    return out, seen[0]


def test_rate_zero_and_eval_mode_are_the_transformers_path_bitwise():
    tower, pixels = _tower(), torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        want = tower.model(pixel_values=pixels).pooler_output
        assert torch.equal(tower._encode(pixels, 0.0), want)  # the reproduced path, nothing dropped
        assert torch.equal(tower.train()(pixels), want)  # p = 0 while training
        tower.patch_dropout = 0.5
        out, seen = _tokens_seen(tower.eval(), pixels)
        assert seen == 17 and torch.equal(out, want)  # eval keeps every token
        assert tower.attention_maps(pixels).shape == (3, 2, 4, 4)  # mask probing sees the whole grid


@pytest.mark.parametrize("p,kept", [(0.5, 8), (0.75, 4), (0.95, 1)])
def test_training_sees_cls_and_the_kept_share_of_patches(p, kept):
    tower, pixels = _tower(p).train(), torch.randn(3, 3, 16, 16)
    assert kept_patches(16, p) == kept
    out, seen = _tokens_seen(tower, pixels)
    assert seen == 1 + kept and out.shape == (3, 32)
    out.square().sum().backward()
    assert all(q.grad is not None and torch.isfinite(q.grad).all() for q in tower.parameters())
    assert tower.model.embeddings.patch_embedding.weight.grad.abs().sum() > 0


def test_the_same_rng_state_drops_the_same_tokens_and_another_seed_others():
    tower, pixels = _tower(0.5).train(), torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        torch.manual_seed(1)
        state = torch.get_rng_state()
        first = tower(pixels)
        torch.set_rng_state(state)  # what a gradient-caching trainer does before its second pass
        assert torch.equal(tower(pixels), first)
        torch.manual_seed(2)
        other = tower(pixels)
    assert not torch.allclose(other, first)
    # per image: rows differ in which patches they keep (the same image twice, two subsets)
    with torch.no_grad():
        twice = tower(pixels[:1].expand(2, -1, -1, -1))
    assert not torch.allclose(twice[0], twice[1])


def test_dropped_tokens_are_a_subset_of_each_images_own():
    from nclip.models.patch_dropout import drop_patches

    tokens = torch.arange(2 * 17, dtype=torch.float32).view(2, 17, 1).expand(-1, -1, 3)
    kept = drop_patches(tokens, 0.5)  # [2, 9, 3]
    assert kept.shape == (2, 9, 3) and torch.equal(kept[:, 0], tokens[:, 0])
    for b in range(2):
        ids = kept[b, 1:, 0].long() - 17 * b  # positions 1..16 of image b, none twice
        assert len(set(ids.tolist())) == 8 and ids.min() >= 1 and ids.max() <= 16


def test_schedule_and_setter(micro_overrides):
    cfg = resolve("micro", micro_overrides + ["model.vision.patch_dropout=0.5", "train.unmasked_steps=2"])
    assert [patch_dropout_at(cfg, s) for s in range(6)] == [0.5, 0.5, 0.5, 0.5, 0.0, 0.0]
    model = build_model(cfg, pretrained_text=False)
    assert model.vision.patch_dropout == 0.5
    set_patch_dropout(model, 0.0)
    assert model.vision.patch_dropout == 0.0
    plain = resolve("micro", micro_overrides)
    assert {patch_dropout_at(plain, s) for s in range(6)} == {0.0}
    convnet = build_model(resolve("micro", micro_overrides + [
        "model.vision.kind=convnet", "model.vision.embedding_size=8", "model.vision.depths=[1,2]",
        "model.vision.hidden_sizes=[8,16]", "model.vision.heads=2"]), pretrained_text=False)
    set_patch_dropout(convnet, 0.0)  # nothing to set
    with pytest.raises(ValueError, match="convnet image tower has no patch dropout"):
        set_patch_dropout(convnet, 0.5)


@pytest.mark.parametrize("overrides,message", [
    (["model.vision.kind=convnet", "model.vision.patch_dropout=0.5"], "patch_dropout needs kind vit"),
    (["model.vision.patch_dropout=1.0"], "model.vision.patch_dropout: Input should be less than 1"),
    (["model.vision.patch_dropout=-0.1"], "greater than or equal to 0"),
    (["train.unmasked_steps=2"], "train.unmasked_steps 2 needs model.vision.patch_dropout > 0"),
    (["model.vision.patch_dropout=0.5", "train.unmasked_steps=7"], "unmasked_steps 7 exceeds steps 6"),
])  # fmt: skip
def test_config_errors(micro_overrides, overrides, message):
    with pytest.raises(NclipError, match=message):
        resolve("micro", micro_overrides + overrides)


@pytest.mark.slow
def test_a_run_with_patch_dropout_and_checkpointing_trains_and_resumes_exactly(tmp_path, micro_overrides):
    """The dropped patches come from the trainer's checkpointed RNG state: a resumed run logs the
    very same metrics."""
    from conftest import metrics_then_resumed

    cfg = resolve("micro", micro_overrides + ["model.vision.patch_dropout=0.5", "model.grad_checkpointing=true"])
    first, again = metrics_then_resumed(cfg, tmp_path / "run")
    assert first == again and len(first) == 3


@pytest.mark.slow
def test_the_trainer_drops_patches_until_the_unmasked_tail(tmp_path, micro_overrides, monkeypatch):
    """FLIP's unmasked tuning in a real run: the loop sets each step's rate before the step, 0 for
    the last ``train.unmasked_steps``; with exact accumulation both tower passes see that rate."""
    import nclip.train.step as step_mod
    from nclip.train.loop import train

    seen = []
    real = step_mod.set_patch_dropout

    def recording(model, p):
        seen.append(p)
        real(model, p)

    monkeypatch.setattr(step_mod, "set_patch_dropout", recording)
    cfg = resolve("micro", micro_overrides + ["model.vision.patch_dropout=0.5", "train.unmasked_steps=2",
                                              "train.accumulation=2"])
    train(cfg, tmp_path, progress=False, evaluate=False)
    assert seen == [0.5, 0.5, 0.5, 0.5, 0.0, 0.0]
