"""Format versions: a model or a training checkpoint written by an nclip of another layout is refused
in one line naming the file, the version found and the version needed (exit 2, no traceback), by
``nclip eval``, ``nclip train --resume`` and ``nclip.load``; and step_N directory names are read in
one place."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import nclip
from nclip.cli import main
from nclip.errors import NclipError
from nclip.models.io import MODEL_FORMAT, WEIGHTS, checkpoint_step, read_weights
from nclip.train.checkpoint import FORMAT, checkpoint_dir, list_checkpoints, newest_good_checkpoint, read_checkpoint

from conftest import micro_sizes

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SETS = [x for o in micro_sizes() + ["train.steps=2", "train.checkpoint_every=2", "train.threads=1"]
        for x in ("--set", o)]


@pytest.fixture(scope="module")
def fresh_run(tmp_path_factory):
    """A two-step micro run of this nclip: RUN/model/ and RUN/checkpoints/step_00000002."""
    run = tmp_path_factory.mktemp("fresh") / "run"
    assert main(["train", "--preset", "micro", "--out", str(run), "--no-progress", "--no-eval", *SETS]) == 0
    return run


def _as_before_versions(weights_file) -> None:
    """Rewrite a weights file as nclip wrote it before model formats were kept: no version in its header."""
    save_file(load_file(str(weights_file)), str(weights_file), metadata={"format": "nclip"})


@pytest.fixture
def old_run(fresh_run, tmp_path):
    """``fresh_run`` as an older nclip left it: state.pt of format 2, weights without a model format."""
    run = tmp_path / "old"
    shutil.copytree(fresh_run, run)
    ckpt = checkpoint_dir(run, 2)
    state = torch.load(ckpt / "state.pt", weights_only=True)
    torch.save({**state, "format": 2}, ckpt / "state.pt")
    for weights in (ckpt / WEIGHTS, run / "model" / WEIGHTS):
        _as_before_versions(weights)
    return run


def _one_line(capsys) -> str:
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.err + out.out, out.err
    return lines[0]


def test_this_nclip_reads_what_it_writes(fresh_run):
    weights, state = read_checkpoint(checkpoint_dir(fresh_run, 2))
    assert state["format"] == FORMAT == 3 and weights
    assert read_weights(fresh_run / "model" / WEIGHTS).keys() == weights.keys()
    assert MODEL_FORMAT == 2


@pytest.mark.slow
def test_resuming_an_older_checkpoint_is_one_line(old_run, capsys):
    capsys.readouterr()
    assert main(["train", "--out", str(old_run), "--extend-to", "4", "--no-progress", "--no-eval"]) == 2
    line = _one_line(capsys)
    state = checkpoint_dir(old_run, 2) / "state.pt"
    assert line.startswith(f"nclip: error: {state} is a training state of format 2, this nclip reads format 3 "
                           "only"), line
    assert "skipping damaged" not in line and len(list_checkpoints(old_run)) == 1  # refused, not taken for damage


def test_an_older_checkpoint_is_not_skipped_for_an_older_good_one(old_run, fresh_run):
    """A checkpoint of another format is not damaged: trying the ones before it would resume from
    further back without saying why."""
    shutil.copytree(checkpoint_dir(fresh_run, 2), checkpoint_dir(old_run, 1))  # an older step, this format
    with pytest.raises(NclipError, match="format 2, this nclip reads format 3"):
        newest_good_checkpoint(old_run)


def test_older_checkpoint_weights_are_refused_too(fresh_run, tmp_path):
    ckpt = tmp_path / "step_00000002"
    shutil.copytree(checkpoint_dir(fresh_run, 2), ckpt)
    _as_before_versions(ckpt / WEIGHTS)
    with pytest.raises(NclipError, match=f"{ckpt / WEIGHTS} is an nclip model of format 1, this nclip reads format 2"):
        read_checkpoint(ckpt)


@pytest.mark.slow
def test_evaluating_an_older_run_is_one_line(old_run, tmp_path, capsys):
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(old_run), "--out", str(tmp_path / "ev"), "--tasks", "zeroshot"]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"nclip: error: {old_run / 'model' / WEIGHTS} is an nclip model of format 1, this nclip "
                           "reads format 2 only"), line


def test_loading_an_older_model_is_one_error(old_run):
    with pytest.raises(NclipError, match="is an nclip model of format 1, this nclip reads format 2 only") as e:
        nclip.load(old_run / "model")
    assert str(old_run / "model" / WEIGHTS) in str(e.value) and "\n" not in str(e.value)


def test_a_merge_writes_this_format(fresh_run, tmp_path):
    from nclip.models.merge import merge

    out = merge(fresh_run, fresh_run, 0.5, tmp_path / "merged")
    assert read_weights(out / WEIGHTS).keys() == read_weights(fresh_run / "model" / WEIGHTS).keys()


@pytest.mark.parametrize(("name", "step"), [("step_00000012", 12), ("step_7", 7), ("step_", None), ("step_1a", None),
                                            ("step_-1", None), ("steps_00000012", None), ("step_１２", None)])
def test_step_names_are_read_in_one_place(tmp_path, name, step):
    assert checkpoint_step(tmp_path / name) == step
