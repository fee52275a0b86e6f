"""xCLIP Tab. 9f "debiased sampling": with data.sampling per_source every global batch comes from one
WebDataset source, drawn ∝ weight from (seed, step) alone — the same on every rank and worker, and on
resume."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import nclip.data.webdataset as webdataset
from nclip.batch import Batch
from nclip.config import resolve
from nclip.data.shards import ShardWriter
from nclip.data.webdataset import ShardStreamDataset, batch_source
from nclip.errors import NclipError

from conftest import metrics_then_resumed


def _write(directory, n, prefix, seed):
    rng = np.random.default_rng(seed)
    with ShardWriter(directory, 6, "png") as w:
        for i in range(n):
            w.write(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8), f"{prefix} number {i}", {"i": i})
    return [str(p) for p in w.paths]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    return [{"shards": _write(root / "a", 30, "alpha", 1), "weight": 3.0},
            {"shards": _write(root / "b", 20, "beta", 2), "weight": 1.0}]


def _cfg(sources, *extra):
    return resolve("micro", ["data.source=webdataset", f"data.sources={json.dumps(sources)}",
                             "data.sampling=per_source", "data.shuffle_buffer=5", "train.batch_size=8", *extra])


def _captions(items):  # a collate that keeps the captions (as the ids), to see where every row came from
    return Batch(torch.stack([x[0] for x in items]), [x[1] for x in items], None), {}


def _batches(cfg, n, rank=0, world=2, workers=1, start=0, saved=None, monkeypatch=None):
    """``n`` batches of a rank as a DataLoader with ``workers`` workers gives them: batch b from
    worker b mod W (the workers simulated in this process), as (pixels, captions, info)."""
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"num_workers": workers})})
    ds = ShardStreamDataset(cfg, _captions, cfg.train.batch_size // world, rank, world, start)
    ds.plan_resume(saved, True)
    iters, current = [], {}
    monkeypatch.setattr(webdataset, "get_worker_info", lambda: current.get("info"))
    for w in range(workers):
        current["info"] = SimpleNamespace(id=w, num_workers=workers) if workers > 1 else None
        it = iter(ds)
        iters.append((it, next(it)))  # the generator reads its worker info on the first batch
    out = [first for _, first in iters]
    while len(out) < n:
        out.append(next(iters[len(out) % workers][0]))
    return [(batch.pixels, batch.ids, info) for batch, info in out[:n]]


def _source_of(captions):
    kinds = {c.split()[0] for c in captions}
    assert len(kinds) == 1, f"a batch mixes sources: {captions}"
    return {"alpha": 0, "beta": 1}[kinds.pop()]


def test_batch_source_is_a_seeded_draw_by_weight():
    picks = [batch_source(0, s, [3.0, 1.0]) for s in range(2000)]
    assert picks == [batch_source(0, s, [3.0, 1.0]) for s in range(2000)]
    assert 0.72 < 1 - np.mean(picks) < 0.78
    assert picks != [batch_source(1, s, [3.0, 1.0]) for s in range(2000)]  # the seed matters
    assert {batch_source(0, s, [1.0]) for s in range(50)} == {0}


def test_every_batch_is_single_source_and_the_same_across_ranks(sources, monkeypatch):
    cfg = _cfg(sources)
    ranks = [_batches(cfg, 12, rank=r, workers=2, monkeypatch=monkeypatch) for r in range(2)]
    for step, (b0, b1) in enumerate(zip(*ranks)):
        assert _source_of(b0[1]) == _source_of(b1[1]) == batch_source(cfg.seed, step, [3.0, 1.0])
        assert len(b0[1]) == len(b1[1]) == 4 and b0[1] != b1[1]  # each rank its own share of the batch
    assert {_source_of(b[1]) for b in ranks[0]} == {0, 1}
    again = _batches(cfg, 12, rank=0, workers=2, monkeypatch=monkeypatch)  # seeded
    assert [b[1] for b in again] == [b[1] for b in ranks[0]]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(again, ranks[0]))
    # the default mixes the sources per sample: some batch holds both
    mixed = _batches(resolve("micro", ["data.source=webdataset", f"data.sources={json.dumps(sources)}",
                                       "train.batch_size=8"]), 12, monkeypatch=monkeypatch)
    assert any(len({c.split()[0] for c in b[1]}) == 2 for b in mixed)


def test_per_source_stream_resumes_exactly(sources, monkeypatch):
    cfg = _cfg(sources)
    full = _batches(cfg, 9, workers=2, monkeypatch=monkeypatch)
    # the checkpoint at step 4 holds each stream's latest position (the loop's TrainData.state())
    latest = {}
    for *_, info in full[:4]:
        latest[info["stream"]] = [info["consumed"], info["skipped"], *info["sources"]]
    saved = {"kind": "stream", "world_size": 2, "streams": [latest[0], latest[1]]}
    assert all(len(s) == 4 and s[0] == s[2] + s[3] for s in saved["streams"])
    resumed = _batches(cfg, 5, workers=2, start=4, saved=saved, monkeypatch=monkeypatch)
    for a, b in zip(full[4:], resumed):
        assert a[1] == b[1] and torch.equal(a[0], b[0])


def test_per_source_needs_weighted_sources():
    with pytest.raises(NclipError, match="data.sampling per_source needs data.source webdataset with data.sources"):
        resolve("micro", ["data.sampling=per_source"])


@pytest.mark.slow
def test_training_with_debiased_sampling_and_nclip_warmup_resumes_bitwise(sources, tmp_path, micro_overrides):
    """Tab. 9f's two techniques in one micro xCLIP run: λ_nCLIP as logged follows the ramp, and a
    run resumed from its step-3 checkpoint writes the same metrics as the uninterrupted one."""
    from nclip.objectives.nclip import nclip_weight_at

    cfg = _cfg(sources, *micro_overrides, "train.log_every=1", "train.threads=1", "objective.name=xclip",
               "objective.nclip_warmup_start=1", "objective.nclip_warmup_steps=3")
    rows, again = metrics_then_resumed(cfg, tmp_path / "a")  # resumed from step 3
    assert [r["nclip/lambda"] for r in rows] == pytest.approx([nclip_weight_at(r["step"] - 1, 1.0, 1, 3)
                                                              for r in rows])
    assert [r["nclip/lambda"] for r in rows] == pytest.approx([0, 0, 1 / 3, 2 / 3, 1, 1])
    assert again == rows
