"""A training step in float64 from a micro config, and the check that ``k`` micro-batches through the
gradient cache give the whole batch's terms and gradients (to 1e-10): shared by the data features'
exactness tests (several captions, hard negatives)."""

from __future__ import annotations

import torch

from nclip.config import resolve
from nclip.data.loader import train_loader
from nclip.models import build_model
from nclip.objectives import build_objective
from nclip.train.accumulate import cached_step, online_towers
from nclip.train.launch import DistContext
from nclip.train.snapshot import BufferSnapshot
from nclip.train.step import TrainStep, wrap_passes

from conftest import micro_sizes


def float64_step(overrides: list[str]):
    """(cfg, a float64 TrainStep, its first training batch in float64) of ``micro`` with ``overrides``."""
    cfg = resolve("micro", micro_sizes() + overrides)
    torch.manual_seed(0)
    model = build_model(cfg).double()
    objective = build_objective(cfg.objective, cfg).double()
    batch = next(iter(train_loader(cfg, model.tokenizer)))
    return cfg, TrainStep(model, objective), batch.with_pixels(batch.pixels.double())


def _grads(step) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in step.named_parameters() if p.grad is not None}


def assert_micro_batches_equal_whole(overrides: list[str], k: int) -> None:
    """Terms and gradients of one whole-batch step against ``k`` micro-batches through the gradient
    cache (``train.accumulation`` set to 1 and ``k`` after ``overrides``), the text tower among those
    that got gradients."""
    _, step, batch = float64_step(overrides + ["train.accumulation=1"])
    terms = step(batch)
    terms["loss"].backward()
    want = ({key: v.detach() for key, v in terms.items()}, _grads(step))
    cfg, step, batch = float64_step(overrides + [f"train.accumulation={k}"])
    towers, heads = wrap_passes(step, DistContext(), cfg)
    got_terms = cached_step(towers, heads, batch, k, BufferSnapshot(online_towers(step.model)), torch.device("cpu"))
    got = ({key: torch.as_tensor(v).detach() for key, v in got_terms.items()}, _grads(step))
    for part, a, b in zip(("term", "gradient"), got, want):
        assert set(a) == set(b), (part, set(a) ^ set(b))
        for key in b:
            torch.testing.assert_close(a[key].double(), b[key].double(), rtol=1e-10, atol=1e-10, msg=f"{part} {key}")
    assert any("text" in name for name in want[1])
