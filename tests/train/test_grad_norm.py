"""The step's gradient norm: with ``train.grad_clip: null`` it is computed and logged, and no
gradient is rescaled (``clip_grad_norm_(…, inf)`` multiplied every gradient by 1.0)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from nclip.config import resolve
from nclip.train.loop import train

from conftest import micro_sizes

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.slow
def test_without_grad_clip_the_norm_is_the_clipping_norm_and_nothing_is_rescaled(tmp_path, monkeypatch):
    real_clip, real_norm = torch.nn.utils.clip_grad_norm_, torch.nn.utils.get_total_norm
    seen = []

    def norm_only(grads, *args, **kwargs):
        got = real_norm(grads, *args, **kwargs)
        copies = [nn.Parameter(torch.zeros_like(g)) for g in grads]  # what the clipping call returned
        for c, g in zip(copies, grads):
            c.grad = g.detach().clone()
        seen.append((got.detach().clone(), real_clip(copies, math.inf)))
        return got

    def no_clip(*args, **kwargs):
        raise AssertionError("clip_grad_norm_ called with train.grad_clip null")

    monkeypatch.setattr(torch.nn.utils, "get_total_norm", norm_only)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", no_clip)
    cfg = resolve("micro", micro_sizes() + ["train.grad_clip=null", "train.steps=2", "train.log_every=1",
                                            "data.train_length=32", "train.eval_every=0"])
    train(cfg, tmp_path, progress=False, evaluate=False)
    assert len(seen) == 2 and all(torch.equal(got, clipped) for got, clipped in seen)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["grad_norm"] for r in rows] == [pytest.approx(float(got), rel=1e-12) for got, _ in seen]
    assert all(r["grad_norm"] > 0 for r in rows)
