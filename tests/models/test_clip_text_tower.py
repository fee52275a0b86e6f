"""The causal CLIP text tower runs without a padding mask (issue 24): its pooled feature does not
depend on it."""

import pytest
import torch

from nclip.config import TextConfig
from nclip.data.tokenization import CaptionTokenizer
from nclip.models.towers import ClipTextTower, text_config

# lengths 2 to 16 tokens (the last one truncated: no padding at all)
CAPTIONS = ["a", "a red circle", "two blue squares left of a green star",
            "the red circle left of a blue square and two more green stars above a yellow triangle"]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)], ids=["fp32", "fp64"])
@pytest.mark.parametrize("eos_pooling", ["token", "argmax"])
def test_pooled_feature_is_the_same_with_and_without_the_padding_mask(eos_pooling, dtype, tol):
    tokenizer = CaptionTokenizer(16)
    cfg = TextConfig(width=32, layers=2, heads=2, eos_pooling=eos_pooling)
    torch.manual_seed(0)
    tower = ClipTextTower(text_config(cfg, tokenizer.vocab_size, 16, tokenizer.pad_id, tokenizer.cls_id,
                                      tokenizer.eos_id)).to(dtype).eval()
    ids, mask = tokenizer(CAPTIONS)
    assert mask.sum(1).tolist()[0] < 16 and mask.sum(1).tolist()[-1] == 16  # padded and unpadded rows
    with torch.no_grad():
        masked = tower.model(input_ids=ids, attention_mask=mask).pooler_output
        ours = tower(ids, mask)
        unmasked = tower(ids, torch.ones_like(mask))  # the mask is not read
    assert ours.dtype == dtype and ours.shape == (4, 32)
    torch.testing.assert_close(ours, masked, rtol=0, atol=tol)
    assert torch.equal(ours, unmasked)
