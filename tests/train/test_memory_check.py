"""A batch that cannot fit is refused before the first step, in one line naming the largest that fits;
a step that runs out of memory all the same is one line saying what to lower (issue 28.4)."""

from __future__ import annotations

import re

import pytest
import torch

import nclip.train.memory_check as memory_check
from nclip.cli import main

from conftest import micro_sizes

MIB = 2**20
QUIET = ["--no-progress", "--no-eval"]


def _sets(*extra: str) -> list[str]:
    overrides = [*micro_sizes(), "train.steps=2", "train.warmup_steps=1", "train.log_every=1", "train.threads=1",
                 *extra]
    return [x for o in overrides for x in ("--set", o)]


def _machine_with(monkeypatch, mib: float) -> None:
    monkeypatch.setattr(memory_check, "available_bytes", lambda device, ranks=1: (mib * MIB, "MemAvailable"))


def test_a_batch_that_cannot_fit_is_refused_in_one_line_and_the_rerun_needs_no_force(tmp_path, monkeypatch, capsys):
    _machine_with(monkeypatch, 40)
    run = tmp_path / "run"
    assert main(["train", "--preset", "micro", "--out", str(run), *QUIET, *_sets("train.batch_size=100000")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("nclip: error: train.batch_size 100000 needs about "), err
    assert "of the 40 MiB available (MemAvailable)" in err[0] and "model.grad_checkpointing" in err[0], err
    largest = int(re.search(r"the largest that fits is about train.batch_size=(\d+)", err[0]).group(1))
    assert 8 <= largest < 100000
    assert not run.exists() or not any(p.name != ".nclip.lock" for p in run.iterdir())
    # the batch it names passes the check on the same machine, in the same directory, without --force
    assert main(["train", "--preset", "micro", "--out", str(run), *QUIET,
                 *_sets(f"train.batch_size={largest}", "train.steps=1")]) == 0
    # and the check can be turned off
    assert memory_check.out_of_memory_message  # (the refusal named the key that does)
    assert main(["train", "--preset", "micro", "--out", str(tmp_path / "off"), *QUIET,
                 *_sets("train.batch_size=16", "train.memory_check=false", "train.steps=1")]) == 0


def test_a_small_batch_is_not_probed(tmp_path, monkeypatch):
    def probe(cfg, learner):
        raise AssertionError("probed a batch that obviously fits")

    monkeypatch.setattr(memory_check, "_probe", probe)
    assert main(["train", "--preset", "micro", "--out", str(tmp_path), *QUIET,
                 *_sets("train.batch_size=8", "train.steps=1")]) == 0


def test_the_probe_leaves_the_run_as_it_found_it(tmp_path, monkeypatch):
    """A run whose batch was probed writes the metrics of one that was not."""
    import json

    from nclip.train.logbook import WALL_CLOCK

    rows = {}
    for name, mib in (("probed", 4096.0), ("plain", None)):
        if mib is None:
            monkeypatch.setattr(memory_check, "PESSIMISTIC_BYTES", 0)  # obviously small: no probe
        else:
            _machine_with(monkeypatch, mib)
            monkeypatch.setattr(memory_check, "PESSIMISTIC_BYTES", 10**9)  # always probe
        assert main(["train", "--preset", "micro", "--out", str(tmp_path / name), *QUIET,
                     *_sets("train.batch_size=8", "model.vision.patch_dropout=0.5")]) == 0
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        rows[name] = [{k: v for k, v in json.loads(x).items() if k not in WALL_CLOCK}
                      for x in lines]
    assert rows["probed"] == rows["plain"]


def test_out_of_memory_in_a_step_is_one_line_saying_what_to_lower(tmp_path, monkeypatch, capsys):
    import nclip.train.loop as loop

    def oom(info, learner, step, batch):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(loop, "_step", oom)
    assert main(["train", "--preset", "micro", "--out", str(tmp_path), *QUIET, *_sets("train.batch_size=8")]) == 2
    out = capsys.readouterr().err
    err = [line for line in out.splitlines() if line.startswith("nclip:")]  # after the start-up block
    assert "Traceback" not in out and len(err) == 1, err
    assert err[0].startswith("nclip: error: out of memory on cpu in step 1 "), err
    for what in ("train.batch_size", "train.accumulation", "model.grad_checkpointing", "patch_dropout"):
        assert what in err[0]


@pytest.mark.parametrize("limit, expected", [(3 * 2**30, 1024), (2**31, 0)])
def test_largest_batch_is_shared_with_the_bench(limit, expected):
    from nclip.bench import batch_memory

    assert batch_memory.largest_batch is memory_check.largest_batch
    assert memory_check.largest_batch(2 * 2**30, MIB, limit) == expected
