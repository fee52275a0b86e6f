"""Faults: non-finite steps are skipped and counted (and stop the run after too many in a row),
unsafe checkpoints are refused, and user mistakes give one line and exit code 2."""

from __future__ import annotations

import json

import pytest
import torch

import nclip.train.loop as loop_mod
from nclip.cli import main
from nclip.config import resolve
from nclip.errors import NclipError
from nclip.train.checkpoint import list_checkpoints, read_checkpoint
from nclip.train.loop import train

from conftest import micro_sizes

OVERRIDES = micro_sizes() + [
    "train.steps=8", "train.batch_size=16", "train.warmup_steps=1", "train.log_every=1",
    "train.checkpoint_every=2", "train.keep_checkpoints=10", "train.threads=1", "data.train_length=128",
]


def _poison_batches(monkeypatch, bad_steps):
    """Make the pixels of the given (0-based) steps NaN: the towers, the BatchNorm statistics of the
    nCLIP heads and the loss all go non-finite, as with a corrupt batch."""
    real = loop_mod.train_loader

    class Poisoned:
        def __init__(self, data, start):
            self.data, self.start = data, start

        def __getattr__(self, name):
            return getattr(self.data, name)

        def __iter__(self):
            for step, batch in enumerate(self.data, start=self.start):
                if step in bad_steps:  # float pixels: the feed passes them as they are
                    batch = batch.with_pixels(torch.full(batch.pixels.shape, float("nan")))
                yield batch

    def fake(cfg, tokenizer, start_step=0, **kw):
        return Poisoned(real(cfg, tokenizer, start_step=start_step, **kw), start_step)

    monkeypatch.setattr(loop_mod, "train_loader", fake)


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_nonfinite_steps_are_skipped_and_counted(tmp_path, monkeypatch):
    _poison_batches(monkeypatch, {2, 3})
    train(resolve("micro", OVERRIDES), tmp_path, progress=False, evaluate=False)
    rows = _rows(tmp_path)
    assert [r["nonfinite_steps"] for r in rows] == [0, 0, 1, 2, 2, 2, 2, 2]
    assert all(r["loss"] == r["loss"] for i, r in enumerate(rows) if i not in (2, 3))  # finite elsewhere
    # the skipped steps left no trace: weights, optimizer state and BatchNorm statistics are finite
    weights, state = read_checkpoint(list_checkpoints(tmp_path)[-1])
    assert all(torch.isfinite(v.float()).all() for v in weights.values())
    assert any("running_var" in k for k in weights)
    assert state["counters"] == {"nonfinite_total": 2, "nonfinite_row": 0}


@pytest.mark.slow
def test_too_many_nonfinite_steps_in_a_row_stop_the_run(tmp_path, monkeypatch):
    _poison_batches(monkeypatch, set(range(5, 100)))
    cfg = resolve("micro", OVERRIDES + ["train.max_nonfinite_steps=3"])
    with pytest.raises(NclipError, match=r"3 steps in a row had a non-finite loss .*step 8.*last good checkpoint") as e:
        train(cfg, tmp_path, progress=False, evaluate=False)
    # it names the checkpoint that exists, and the setting that fits xCLIP at the default λs: the lr
    assert str(tmp_path / "checkpoints" / "step_00000004") in str(e.value) and "lower train.lr" in str(e.value)
    # checkpoints 2 and 4 are kept; none was written during the streak (step 6)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000004"]
    assert _rows(tmp_path)[-1]["nonfinite_steps"] == 3


class Payload:
    """Any custom class: unpickling it would import and run code from this module."""

    def __init__(self):
        self.note = "not a tensor"


@pytest.mark.slow
def test_a_checkpoint_that_would_unpickle_code_is_refused(tmp_path, capsys):
    cfg = resolve("micro", OVERRIDES + ["train.steps=2"])
    train(cfg, tmp_path, progress=False, evaluate=False)
    ckpt = list_checkpoints(tmp_path)[-1]
    state = torch.load(ckpt / "state.pt", weights_only=True)
    torch.save({**state, "extra": Payload()}, ckpt / "state.pt")
    with pytest.raises(NclipError, match="refusing to load .*state.pt"):
        read_checkpoint(ckpt)
    # through the CLI: one line, exit code 2, nothing resumed from it
    args = ["train", "--preset", "micro", "--out", str(tmp_path), "--extend-to", "4", "--no-progress",
            "--no-eval"] + [x for o in OVERRIDES + ["train.steps=2"] for x in ("--set", o)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("nclip: error: no usable checkpoint") and "refusing to load" in err[-1]


@pytest.mark.parametrize("overrides, message", [
    (["data.source=webdataset", "data.shards=/nonexistent/{00000..00003}.tar"],
     "data.shards: shard not found: /nonexistent/00000.tar (and 3 more of 4)"),
    (["data.source=webdataset", "data.shards=/tmp/{0..3.tar"], "cannot expand shard pattern"),
    (["data.source=webdataset"], "needs exactly one of data.shards or data.sources"),
    (["data.source=csv", "data.csv=/nonexistent/pairs.csv"], "data.csv: file not found"),
])
def test_bad_data_paths_give_one_line_and_exit_2(tmp_path, capsys, overrides, message):
    args = ["train", "--preset", "micro", "--out", str(tmp_path / "run"), "--no-progress"]
    args += [x for o in overrides for x in ("--set", o)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_empty_or_malformed_csv_give_one_line(tmp_path, capsys):
    empty = tmp_path / "empty.csv"
    empty.write_text("filepath,title\n")
    wrong = tmp_path / "wrong.csv"
    wrong.write_text("path,caption\na.jpg,hello\n")
    missing = tmp_path / "missing.csv"
    missing.write_text("filepath,title\nnope/a.jpg,hello\n")
    for path, message in ((empty, "no rows"), (wrong, "no column 'filepath'"),
                          (missing, "none of the first 1 images exist")):
        args = ["train", "--preset", "micro", "--out", str(tmp_path / "run"), "--no-progress",
                "--set", "data.source=csv", "--set", f"data.csv={path}"]
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err


@pytest.mark.slow
def test_every_state_pt_damaged_is_one_line_with_the_way_out(tmp_path, capsys):
    """Issue 28.11: not a warning per damaged checkpoint and torch's explanations, but one line."""
    sets = [x for o in OVERRIDES + ["train.steps=4"] for x in ("--set", o)]
    assert main(["train", "--preset", "micro", "--out", str(tmp_path), "--no-progress", "--no-eval", *sets]) == 0
    found = list_checkpoints(tmp_path)
    assert len(found) == 2
    intact = (found[0] / "state.pt").read_bytes()
    for ckpt in found:
        data = (ckpt / "state.pt").read_bytes()
        (ckpt / "state.pt").write_bytes(data[: len(data) // 2])
    capsys.readouterr()
    assert main(["train", "--out", str(tmp_path), "--extend-to", "6", "--no-progress", "--no-eval"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"nclip: error: no usable checkpoint in {tmp_path / 'checkpoints'}: "
                                               "all 2 checkpoints are damaged (newest: cannot read checkpoint"), err
    assert "start over with --force" in err[0] and len(err[0].replace(str(tmp_path), "R")) < 300, err
    # the older one mended: one warning names the damaged newer one, and the run goes on from the older
    (found[0] / "state.pt").write_bytes(intact)
    assert main(["train", "--out", str(tmp_path), "--extend-to", "6", "--no-progress", "--no-eval"]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("nclip:")]
    assert err[0].startswith(f"nclip: warning: skipping damaged checkpoint {found[1].name}: cannot read"), err
