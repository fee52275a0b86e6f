"""A run with no completed step is not a run (docs/runs.md, issue 28.5): what a run that died in its
start-up left (config.yaml, an empty metrics.jsonl, an interrupted write's temporaries) does not
block the rerun; anything that shows a completed step still does, and is never removed. And a
Ctrl-C says how to go on (issue 28.11)."""

from __future__ import annotations

import hashlib
import shlex
from pathlib import Path

import pytest

from nclip.cli import main
from nclip.config import resolve, to_yaml
from nclip.errors import NclipError
from nclip.train.rundir import has_completed_step, plan_run

from conftest import MICRO_OVERRIDES

QUIET = ["--no-progress", "--no-eval"]
SETS = [x for o in MICRO_OVERRIDES for x in ("--set", o)]


def _hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _startup_leftovers(run: Path) -> None:
    """What a run stopped before its first step leaves: config.yaml and an empty metrics.jsonl."""
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(to_yaml(resolve("micro", list(MICRO_OVERRIDES))))
    (run / "metrics.jsonl").write_text("")
    (run / "notes.txt").write_text("mine\n")


def _partial_checkpoint_write(run: Path) -> None:  # killed while writing its first checkpoint
    (run / "checkpoints" / ".step_00000003.k2j4").mkdir(parents=True)
    (run / "checkpoints" / ".step_00000003.k2j4" / "model.safetensors").write_bytes(b"\0" * 10)


def _comment_config(run: Path) -> None:
    (run / "config.yaml").write_text("# my own settings\n" + (run / "config.yaml").read_text())


EVIDENCE = {
    "a logged step": lambda run: (run / "metrics.jsonl").write_text('{"step": 2, "loss": 1.0}\n'),
    "a torn log line": lambda run: (run / "metrics.jsonl").write_text('{"step": 2, "lo'),
    "a checkpoint": lambda run: (run / "checkpoints" / "step_00000003").mkdir(parents=True),
    "a damaged checkpoint": lambda run: ((run / "checkpoints" / "step_00000003").mkdir(parents=True),
                                         (run / "checkpoints" / "step_00000003" / "state.pt").write_text("x")),
    "a model": lambda run: (run / "model").mkdir(),
    "eval.json": lambda run: (run / "eval.json").write_text("{}"),
    "an episode": lambda run: (run / "episodes.jsonl").write_text('{"episode": 0}\n'),
    # not evidence of a step, but not the trainer's config.yaml either: the user's own file, kept
    "the user's config.yaml": lambda run: _comment_config(run),
}


@pytest.mark.parametrize("name", list(EVIDENCE))
def test_a_completed_step_on_disk_is_a_run_and_nothing_is_removed(name, tmp_path):
    run = tmp_path / "R"
    _startup_leftovers(run)
    EVIDENCE[name](run)
    before = _hashes(run)
    assert has_completed_step(run) or name == "the user's config.yaml"
    with pytest.raises(NclipError, match="already holds a run"):
        plan_run(resolve("micro", list(MICRO_OVERRIDES)), run, resume=False, force=False, extend_to=None)
    assert _hashes(run) == before


@pytest.mark.parametrize("extra", [None, _partial_checkpoint_write], ids=["config and empty log", "checkpoint temp"])
def test_startup_leftovers_are_no_run(extra, tmp_path):
    run = tmp_path / "R"
    _startup_leftovers(run)
    if extra:
        extra(run)
    assert not has_completed_step(run)
    cfg = resolve("micro", list(MICRO_OVERRIDES) + ["seed=7"])  # another config: there is no run to differ from
    for resume in (False, True):
        plan = plan_run(cfg, run, resume=resume, force=False, extend_to=None)
        assert plan.cfg == cfg and "config.yaml" in plan.clear and "holds no completed step" in plan.note
    with pytest.raises(NclipError, match="holds no run to extend"):
        plan_run(cfg, run, resume=False, force=False, extend_to=10)


@pytest.mark.slow
def test_ctrl_c_in_start_up_then_the_suggested_command_reuses_the_directory(tmp_path, monkeypatch, capsys):
    import nclip.train.loop as loop

    run = tmp_path / "my run"
    run.mkdir()
    (run / "notes.txt").write_text("mine\n")
    step = loop._step

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "_step", interrupted)
    argv = ["train", "--preset", "micro", "--out", str(run), *QUIET, *SETS, "--set", "train.steps=2"]
    assert main(argv) == 130
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("nclip:")]
    suggested = f"nclip train --out {shlex.quote(str(run))} --resume auto"
    assert err == [f"nclip: interrupted; continue the run from step 0 (no checkpoint yet) with: {suggested}"]
    assert not has_completed_step(run) and (run / "config.yaml").is_file()

    monkeypatch.setattr(loop, "_step", step)
    assert main(argv) == 0  # the same command, no --force: the leftovers are no run
    assert "holds no completed step" in capsys.readouterr().err
    assert (run / "notes.txt").read_text() == "mine\n" and (run / "model").is_dir()


@pytest.mark.slow
def test_ctrl_c_after_a_checkpoint_names_it_and_the_resume_command(tmp_path, monkeypatch, capsys):
    import nclip.train.loop as loop

    run = tmp_path / "R"
    step = loop._step

    def interrupted_at_step_4(info, learner, s, batch):
        if s == 4:
            raise KeyboardInterrupt
        return step(info, learner, s, batch)

    monkeypatch.setattr(loop, "_step", interrupted_at_step_4)
    assert main(["train", "--preset", "micro", "--out", str(run), *QUIET, *SETS]) == 130
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("nclip:")]
    assert err == [f"nclip: interrupted; continue the run from its step-3 checkpoint with: "
                   f"nclip train --out {run} --resume auto"]
    monkeypatch.setattr(loop, "_step", step)
    assert main(shlex.split(err[0].split("with: nclip ")[1]) + QUIET) == 0  # the command it gave
    assert (run / "checkpoints" / "step_00000006").is_dir()
