"""Both towers run their attention through ``torch.nn.functional.scaled_dot_product_attention``
(issue #18), which dispatches to the flash or memory-efficient kernels on a GPU: counted here by
wrapping the function, layer by layer, for every kind of tower a preset can build."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nclip.config import resolve
from nclip.models import build_model

from conftest import micro_sizes


@pytest.fixture
def sdpa_calls(monkeypatch):
    calls = []
    real = F.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
    return calls


@pytest.mark.parametrize("towers, vision_calls, text_calls", [
    (["model.vision.layers=2", "model.text.layers=3"], 2, 3),  # ViT + CLIP text transformer
    (["model.vision.kind=convnet", "model.vision.embedding_size=8", "model.vision.depths=[1,1]",
      "model.vision.hidden_sizes=[8,16]", "model.vision.heads=2", "model.text.kind=pretrained"], 1, 6),  # + MiniLM
])
def test_every_attention_layer_uses_sdpa(sdpa_calls, towers, vision_calls, text_calls):
    cfg = resolve("micro", micro_sizes() + towers)
    model = build_model(cfg, pretrained_text=False)
    ids, mask = model.tokenizer(["a red circle", "two blue squares"])
    model.encode_image(torch.randn(2, 3, 16, 16))
    assert len(sdpa_calls) == vision_calls
    model.encode_text(ids, mask)
    assert len(sdpa_calls) == vision_calls + text_calls
