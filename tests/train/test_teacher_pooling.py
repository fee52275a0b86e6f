"""The external teacher's pooling (``objective.ext_pooling``: mean | eot | cls) and its cache key."""

from __future__ import annotations

import pytest
import torch

from nclip.config import resolve
from nclip.errors import NclipError
from nclip.train import teacher


def test_eot_and_cls_pooling_on_the_bundled_minilm():
    from transformers import AutoModel

    from nclip.data.tokenization import CaptionTokenizer

    enc = teacher.encoder_dir(None)
    captions = ["a red square", "a small blue circle to the left of a large green triangle"]
    eot = teacher.encode_captions(captions, enc, 32, 2, pooling="eot")  # one padded batch of both
    cls = teacher.encode_captions(captions, enc, 32, 2, pooling="cls")
    tok = CaptionTokenizer(32, enc / "tokenizer.json")
    model = AutoModel.from_pretrained(str(enc), local_files_only=True).eval()
    lengths = []
    for i, caption in enumerate(captions):  # each caption alone, no padding at all
        ids, mask = tok([caption])
        n = int(mask.sum())
        lengths.append(n)
        assert int(ids[0, n - 1]) == tok.eos_id  # the last non-padding token is the end of text ([SEP])
        with torch.no_grad():
            states = model(input_ids=ids[:, :n], attention_mask=mask[:, :n]).last_hidden_state[0]  # [n, D]
        torch.testing.assert_close(eot[i], torch.nn.functional.normalize(states[n - 1], dim=0), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(cls[i], torch.nn.functional.normalize(states[0], dim=0), rtol=1e-4, atol=1e-5)
    assert lengths[0] < lengths[1]  # the short caption was padded in the shared batch
    assert not torch.allclose(eot, cls)


def test_pool_on_hand_made_states():
    states = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    torch.testing.assert_close(teacher.pool(states, mask, "eot"), torch.stack([states[0, 1], states[1, 3]]))
    torch.testing.assert_close(teacher.pool(states, mask, "cls"), states[:, 0])
    torch.testing.assert_close(teacher.pool(states, mask, "mean"), torch.stack([states[0, :2].mean(0),
                                                                                   states[1].mean(0)]))
    with pytest.raises(NclipError, match="pooling"):
        teacher.pool(states, mask, "max")


def test_cache_key_includes_the_pooling(tmp_path, monkeypatch):
    monkeypatch.setenv("NCLIP_CACHE", str(tmp_path / "env-cache"))
    seen = []

    def fake(captions, directory, max_length, batch_size, device="cpu", pooling="mean"):
        seen.append(pooling)
        return torch.zeros(len(captions), 4)

    monkeypatch.setattr(teacher, "encode_captions", fake)
    base = ["data.train_length=6", f"objective.ext_cache_dir={tmp_path}"]
    enc = teacher.encoder_dir(None)
    cfg = resolve("protoclip-tiny", base)
    length = cfg.objective.ext_max_length
    keys = {p: teacher._key(teacher.identity(cfg, enc, length, p)) for p in teacher.POOLINGS}
    assert len(set(keys.values())) == 3
    # mean (the default) keeps the identity entries had before pooling was configurable
    assert teacher.identity(cfg, enc, 64)["pooling"] == "mean+l2"
    assert cfg.objective.ext_pooling == "mean"
    for pooling in ("eot", "mean", "eot"):
        c = resolve("protoclip-tiny", base + [f"objective.ext_pooling={pooling}"])
        teacher.teacher_features(c)
    assert seen == ["eot", "mean"]  # the second eot run is a cache hit
    assert sorted(p.name for p in (tmp_path / "teacher").iterdir()) == sorted(
        f"{keys[p]}.safetensors" for p in ("eot", "mean"))
    # the second user (CMSF's cross-modal constraint) keeps its call and its mean-pooled entry
    feats, cached = teacher.caption_features(cfg, None, length, 8, str(tmp_path))
    assert cached and feats.shape == (6, 4)
    with pytest.raises(NclipError, match="ext_pooling"):
        resolve("protoclip-tiny", base + ["objective.ext_pooling=max"])
