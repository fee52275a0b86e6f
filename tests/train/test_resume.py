"""A run killed with SIGKILL at an arbitrary step and resumed with ``--resume auto`` writes the same
metrics.jsonl as a run never interrupted: bitwise, on CPU, wall-clock fields aside."""

from __future__ import annotations

import json
import random

import pytest
import torch

from nclip.cli import main
from nclip.config import resolve
from nclip.train.checkpoint import list_checkpoints, read_checkpoint
from nclip.train.logbook import WALL_CLOCK
from nclip.train.loop import train

from conftest import micro_sizes, train_and_kill

pytestmark = pytest.mark.slow  # every test here trains or spawns processes

# tiny widths, batch 16, 30 steps; checkpoints every 4 steps, a log line every step
OVERRIDES = micro_sizes() + [
    "train.steps=30", "train.batch_size=16", "train.warmup_steps=3", "train.log_every=1",
    "train.checkpoint_every=4", "train.keep_checkpoints=3", "train.threads=1", "data.train_length=256",
]


def _rows(path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:
        for k in WALL_CLOCK:
            r.pop(k, None)
    return rows


def _args(out, extra=()) -> list[str]:
    return ["train", "--preset", "micro", "--out", str(out), "--no-progress", "--no-eval"] + \
        [x for o in [*OVERRIDES, *extra] for x in ("--set", o)]


# exact accumulation: gradient caching replays each micro-batch's random state in its second pass
@pytest.mark.parametrize("extra", [(), ("train.accumulation=4",)], ids=["k1", "exact-k4"])
def test_sigkill_then_resume_writes_the_same_metrics(tmp_path, extra):
    reference = tmp_path / "reference"
    train(resolve("micro", [*OVERRIDES, *extra]), reference, progress=False, evaluate=False)
    expected = _rows(reference / "metrics.jsonl")
    assert [r["step"] for r in expected] == list(range(1, 31))

    # kill at an arbitrary step past the first checkpoint (the exact step is up to the scheduler)
    kill_after = random.Random().randint(5, 24)
    run = tmp_path / "killed"
    metrics = run / "metrics.jsonl"
    train_and_kill(_args(run, extra), metrics, kill_after)
    logged = metrics.read_text().count("\n")
    assert 0 < logged < 30 and list_checkpoints(run), (logged, kill_after)

    assert main(_args(run, extra) + ["--resume", "auto"]) == 0
    got = _rows(metrics)
    assert got == expected, f"killed after {logged} logged steps; first difference at step " + str(
        next((a["step"] for a, b in zip(got, expected) if a != b), "?"))



def test_resume_skips_a_damaged_newest_checkpoint(tmp_path):
    cfg = resolve("micro", OVERRIDES + ["train.steps=12"])
    reference = tmp_path / "reference"
    train(cfg, reference, progress=False, evaluate=False)
    run = tmp_path / "run"
    train(cfg, run, progress=False, evaluate=False)
    # damage the newest checkpoint (12) and drop the last log lines: resume from 8 re-creates them
    newest = list_checkpoints(run)[-1]
    (newest / "model.safetensors").write_bytes(b"\x00" * 10)
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join(lines[:9]) + lines[9][:20])  # and a torn last line
    train(cfg, run, resume=True, progress=False, evaluate=False)
    assert _rows(run / "metrics.jsonl") == _rows(reference / "metrics.jsonl")


def test_checkpoint_holds_everything_needed_to_continue(tmp_path):
    cfg = resolve("micro", OVERRIDES + ["train.steps=4"])
    train(cfg, tmp_path, progress=False, evaluate=False)
    weights, state = read_checkpoint(list_checkpoints(tmp_path)[-1])
    assert state["step"] == 4 and state["world_size"] == 1
    assert "logit_scale" in weights and any(k.startswith("heads.nclip.") for k in weights)
    assert state["optimizer_format"] == "ids" and state["optimizer"]["state"]
    assert set(state["rng"][0]) >= {"torch", "numpy", "python"}
    assert state["data"] == [{"kind": "map", "skipped": 0}]
    assert state["counters"] == {"nonfinite_total": 0, "nonfinite_row": 0}
    # and every tensor in it loads with weights_only (no pickled code)
    torch.load(list_checkpoints(tmp_path)[-1] / "state.pt", weights_only=True)


def test_resuming_a_finished_run_does_nothing(tmp_path):
    cfg = resolve("micro", OVERRIDES + ["train.steps=2"])
    train(cfg, tmp_path, progress=False, evaluate=False)
    stamps = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    result = train(cfg, tmp_path, resume=True, progress=False, evaluate=False)
    assert result.already_finished and result.steps == 2
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == stamps
