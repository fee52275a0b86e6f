"""model.grad_checkpointing: the same loss, gradients and BatchNorm statistics as without, for every
tower kind (float64), with dropout replayed; active only while training with gradients."""

import copy

import pytest
import torch
from torch import nn

from nclip.config import TextConfig, VisionConfig, resolve
from nclip.data.tokenization import CaptionTokenizer, bundled_model_dir
from nclip.models import build_model
from nclip.models.clip_resnet import ClipResNetTower
from nclip.models.towers import (
    ClipTextTower,
    ConvNetTower,
    PretrainedTextTower,
    ResNetTower,
    VisionTower,
    resnet_config,
    text_config,
    vision_config,
)

CAPTIONS = ["a red circle", "two blue squares left of a green star", "a", "the yellow triangle"]


def _vit():
    config = vision_config(VisionConfig(width=32, layers=2, heads=2, patch_size=4), 16)
    config.attention_dropout = 0.2  # something drawn from the RNG, to be replayed in the backward
    return VisionTower(config), (torch.randn(4, 3, 16, 16),)


def _convnet():
    cfg = VisionConfig(kind="convnet", embedding_size=8, depths=(1, 2), hidden_sizes=(8, 16), heads=2)
    return ConvNetTower(cfg, 16), (torch.randn(4, 3, 16, 16),)


def _resnet():
    cfg = VisionConfig(kind="resnet", embedding_size=8, depths=(1, 2), hidden_sizes=(16, 32))
    return ResNetTower(resnet_config(cfg)), (torch.randn(4, 3, 32, 32),)


def _clip_resnet():
    cfg = VisionConfig(kind="clip_resnet", embedding_size=8, depths=(1, 2), hidden_sizes=(16, 32), heads=2)
    tower = ClipResNetTower(cfg, 32)
    for m in tower.modules():  # γ ≠ 0 in the blocks' last BatchNorm, so every branch gets a gradient
        if isinstance(m, nn.BatchNorm2d):
            nn.init.uniform_(m.weight, 0.5, 1.5)
    return tower, (torch.randn(4, 3, 32, 32),)


def _groupvit():  # in training mode its grouping draws Gumbel noise
    from nclip.models.groupvit_tower import GroupViTTower, groupvit_config

    cfg = VisionConfig(kind="groupvit", width=32, heads=2, patch_size=4, depths=(1, 1), group_tokens=(4, 0),
                       output_groups=(4, 4))
    return GroupViTTower(groupvit_config(cfg, 16)), (torch.randn(4, 3, 16, 16),)


def _clip_text():
    tok = CaptionTokenizer(16)
    config = text_config(TextConfig(width=32, layers=2, heads=2), tok.vocab_size, 16, tok.pad_id, tok.cls_id,
                         tok.eos_id)
    config.attention_dropout = 0.2
    return ClipTextTower(config), tok(CAPTIONS)


def _minilm():  # BERT's hidden and attention dropout (0.1) are on in training mode
    return PretrainedTextTower(str(bundled_model_dir()), "mean"), CaptionTokenizer(16)(CAPTIONS)


TOWERS = {"vit": _vit, "convnet": _convnet, "resnet": _resnet, "clip_resnet": _clip_resnet, "clip_text": _clip_text,
          "minilm": _minilm, "groupvit": _groupvit}


def _count_layer_calls(tower: nn.Module, calls: list) -> list:
    """Hooks that count the forwards of every linear and conv layer (a recomputation adds some)."""
    return [m.register_forward_hook(lambda *_: calls.append(1)) for m in tower.modules()
            if isinstance(m, (nn.Linear, nn.Conv2d))]


def _step(tower: nn.Module, inputs) -> tuple[torch.Tensor, int]:
    """Loss, gradients in .grad, and how many linear/conv layer forwards ran."""
    calls = []
    hooks = _count_layer_calls(tower, calls)
    torch.manual_seed(7)  # the same dropout masks for both towers
    feature = tower(*inputs)
    weights = torch.linspace(-1, 1, feature.numel(), dtype=feature.dtype).view_as(feature)
    loss = (feature * weights).sum() + feature.pow(2).mean()
    loss.backward()
    for hook in hooks:
        hook.remove()
    return loss.detach(), len(calls)


@pytest.mark.parametrize("kind", list(TOWERS))
def test_checkpointed_tower_gives_the_same_loss_gradients_and_statistics(kind):
    torch.manual_seed(0)
    plain, inputs = TOWERS[kind]()
    plain = plain.double().train()
    inputs = tuple(x.double() if x.is_floating_point() else x for x in inputs)
    ckpt = copy.deepcopy(plain)
    ckpt.enable_grad_checkpointing()

    loss, plain_calls = _step(plain, inputs)
    ckpt_loss, ckpt_calls = _step(ckpt, inputs)
    assert ckpt_calls > plain_calls  # the backward recomputed the checkpointed layers
    torch.testing.assert_close(ckpt_loss, loss, rtol=0, atol=1e-12)
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-12, msg=name)
    # BatchNorm's running statistics updated once per forward, as without checkpointing
    for (name, b), c in zip(plain.named_buffers(), ckpt.buffers()):
        torch.testing.assert_close(c, b, rtol=0, atol=0, msg=name)
    if kind in ("convnet", "resnet", "clip_resnet"):
        assert max(int(b) for n, b in plain.named_buffers() if n.endswith("num_batches_tracked")) == 1


@pytest.mark.parametrize("kind", ["vit", "convnet", "clip_resnet"])
def test_checkpointing_is_off_in_eval_mode_and_without_gradients(kind):
    torch.manual_seed(0)
    tower, inputs = TOWERS[kind]()
    tower.enable_grad_checkpointing()
    calls = []
    with torch.no_grad():
        tower.train()(*inputs)
    _count_layer_calls(tower, calls)
    with torch.no_grad():
        tower.train()(*inputs)
    once = len(calls)
    tower.eval()(*inputs).sum().backward()
    assert len(calls) == 2 * once  # as many forwards with gradients in eval mode: nothing recomputed


def test_model_grad_checkpointing_reaches_both_towers(micro_overrides):
    cfg = resolve("micro", micro_overrides + ["model.grad_checkpointing=true"])
    model = build_model(cfg, pretrained_text=False)
    assert model.vision.model.encoder.gradient_checkpointing and model.text.model.encoder.gradient_checkpointing
    cfg = resolve("micro", micro_overrides + ["model.grad_checkpointing=true", "model.vision.kind=convnet",
                                              "model.vision.embedding_size=8", "model.vision.depths=[1,2]",
                                              "model.vision.hidden_sizes=[8,16]", "model.vision.heads=2"])
    assert build_model(cfg, pretrained_text=False).vision.grad_checkpointing
    plain = build_model(resolve("micro", micro_overrides), pretrained_text=False)
    assert not plain.vision.model.encoder.gradient_checkpointing
