"""The pretrained (MiniLM) text tower hands transformers a prepared 4-d attention mask: the same
outputs as the 2-d padding mask transformers expands itself, without its host read of
``mask.all()`` at every forward."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from nclip.data.tokenization import CaptionTokenizer, bundled_model_dir
from nclip.models.towers import PretrainedTextTower, _set_impl

from host_syncs import SYNC_OPS

CAPTIONS = ["a red circle", "two blue squares on a wooden table next to a sleeping cat", "a star"]


@pytest.fixture(scope="module")
def tower():
    torch.manual_seed(0)
    return PretrainedTextTower(str(bundled_model_dir()), "mean").eval()


def _batches():
    ids, mask = CaptionTokenizer(16)(CAPTIONS)
    assert not mask.all()  # padded: the mask matters
    return {"padded": (ids, mask), "unpadded": (ids[:, :3], torch.ones_like(mask[:, :3]))}


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_the_prepared_mask_gives_the_outputs_of_the_2d_mask(tower, impl, amp):
    """Bitwise on the CPU, in float32 and under bf16 autocast: the same mask values reach the same
    kernels (with nothing padded transformers passes SDPA no mask, and an all-true mask adds nothing;
    on a GPU that case may pick another SDPA kernel, a difference of float rounding)."""
    _set_impl(tower.model, impl)
    try:
        for name, (ids, mask) in _batches().items():
            with torch.no_grad(), torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
                want = tower.model(input_ids=ids, attention_mask=mask).last_hidden_state
                got = tower.model(input_ids=ids, attention_mask=tower._attention_mask(mask)).last_hidden_state
            assert tower._attention_mask(mask).ndim == 4
            assert torch.equal(got, want), (impl, name)
    finally:
        _set_impl(tower.model, "sdpa")


def test_the_tower_reads_nothing_on_the_host(tower):
    ids, mask = _batches()["padded"]
    x = tower(ids, mask)  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        x = tower(ids, mask)
        x.sum().backward()
    assert not {e.name for e in prof.events() if e.name in SYNC_OPS}
    # the padding is still masked: a caption padded to 16 tokens has its feature padded to 8
    with torch.no_grad():
        long, short = (tower(*CaptionTokenizer(n)(CAPTIONS[:1])) for n in (16, 8))
    torch.testing.assert_close(long, short, rtol=1e-5, atol=1e-5)
