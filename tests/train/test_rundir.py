"""No command may destroy a run (docs/runs.md).

One finished micro run (and one ProtoCLIP run, which also writes episodes.jsonl) is trained once per
module and copied for every case. A refusal is exit code 2, one line on stderr, no traceback, and
every file of the run byte for byte as it was; ``--force``, ``--resume auto`` and ``--extend-to``
do what they say, and nothing more.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from nclip.cli import main
from nclip.config import resolve
from nclip.train.loop import train

from conftest import MICRO_OVERRIDES

USER_FILE = "notes.txt"  # not the trainer's: --force must keep it
QUIET = ["--no-progress", "--no-eval"]
XCLIP = [x for o in MICRO_OVERRIDES for x in ("--set", o)]
PROTO_OVERRIDES = list(MICRO_OVERRIDES) + [
    "data.train_length=64", "model.proto_hidden=64", "model.proto_dim=16", "objective.episode_size=16",
    "objective.clusters=4", "objective.warmup_episodes=1", "objective.w_ext=0", "train.steps=4"]
PROTO = [x for o in PROTO_OVERRIDES for x in ("--set", o)]


def _train_once(root: Path, preset: str, overrides: list[str]) -> Path:
    run = root / preset
    train(resolve(preset, overrides), run, progress=False)
    (run / USER_FILE).write_text("my notes on this run\n")
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    return {"xclip": _train_once(root, "micro", list(MICRO_OVERRIDES)),
            "protoclip": _train_once(root, "protoclip-tiny", PROTO_OVERRIDES)}


def hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root``, by relative path."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def steps_logged(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def checkpoints(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


# ---- what each case checks beyond exit code, stderr and unchanged files -----------------------------


def _started_over(run: Path, before: dict) -> None:
    assert checkpoints(run) == ["step_00000002", "step_00000004"]  # the old 3 and 6 are gone
    assert steps_logged(run) == [2, 4] and not (run / "eval.json").exists()  # --no-eval: the old one is gone
    assert hashes(run)[USER_FILE] == before[USER_FILE]


def _proto_started_over(run: Path, before: dict) -> None:
    episodes = [json.loads(x)["episode"] for x in (run / "episodes.jsonl").read_text().splitlines()]
    assert episodes == [0] and checkpoints(run) == ["step_00000002"]  # 2 steps: one episode of 2
    assert hashes(run)[USER_FILE] == before[USER_FILE]


def _extended(run: Path, before: dict) -> None:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 6, 8, 10]
    assert [r["lr"] for r in rows[3:]] == [1e-5, 1e-5]  # after the 6-step schedule: micro's min_lr
    assert rows[2]["lr"] == pytest.approx(1e-5)  # the schedule's own end: no jump
    cfg = yaml.safe_load((run / "config.yaml").read_text())["train"]
    assert (cfg["steps"], cfg["schedule_steps"]) == (10, 6)
    assert checkpoints(run)[-1] == "step_00000010"


def _resumed_with_its_own_config(run: Path, before: dict) -> None:
    assert steps_logged(run) == [2, 4, 5, 6]  # lines after the step-3 checkpoint rewritten, every step
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["log_every"] == 1
    assert "checkpoints/step_00000006/model.safetensors" in hashes(run)
    # log_every changes no computation: the exact resume ends with the very same weights
    assert hashes(run)["model/model.safetensors"] == before["model/model.safetensors"]


def _exported_over(run: Path, before: dict) -> None:
    # the export replaces the folder whole (written beside it, then renamed): the older file is gone
    assert (run / "hf-old" / "config.json").is_file() and not (run / "hf-old" / "old.txt").exists()
    after = hashes(run)
    assert {k: v for k, v in after.items() if not k.startswith("hf-old/")} == \
        {k: v for k, v in before.items() if not k.startswith("hf-old/")}


# ---- preparations of the copied run ------------------------------------------------------------------


def _drop_last_checkpoint(run: Path) -> None:  # as if killed after step 3
    shutil.rmtree(run / "checkpoints" / "step_00000006")


def _old_export_folder(run: Path) -> None:  # a user's directory inside the run folder
    (run / "hf-old").mkdir()
    (run / "hf-old" / "old.txt").write_text("an older export\n")


@dataclass
class Case:
    name: str
    argv: list[str]  # "{R}" stands for the run's copy
    code: int
    needle: str  # in stderr
    unchanged: bool  # every file of the run byte for byte as it was
    base: str = "xclip"
    lines: int | None = 1  # lines on stderr (None: not checked, e.g. transformers' own progress)
    prepare: Callable[[Path], None] | None = None
    check: Callable[[Path, dict], None] | None = None


CASES = [
    Case("train into a finished run", ["train", "--preset", "micro", "--out", "{R}", *XCLIP, *QUIET], 2,
         "already holds a run", True),
    Case("train into an interrupted run", ["train", "--preset", "micro", "--out", "{R}", *XCLIP, *QUIET], 2,
         "--resume auto", True, prepare=_drop_last_checkpoint),
    Case("--force starts over", ["train", "--preset", "micro", "--out", "{R}", *XCLIP, "--set", "train.steps=4",
                                 "--set", "train.checkpoint_every=2", "--force", *QUIET], 0,
         "--force: starting", False, check=_started_over),
    Case("--force with --resume auto", ["train", "--out", "{R}", "--resume", "auto", "--force", *QUIET], 2,
         "cannot be combined", True),
    Case("resume with a changed model", ["train", "--preset", "micro", "--out", "{R}", *XCLIP, "--resume", "auto",
                                         "--set", "model.vision.width=64", *QUIET], 2,
         "model.vision.width: 32 -> 64", True),
    Case("resume an interrupted run with a changed lr", ["train", "--out", "{R}", "--resume", "auto",
                                                         "--set", "train.lr=0.01", *QUIET], 2,
         "train.lr: 0.002 -> 0.01", True, prepare=_drop_last_checkpoint),
    Case("resume with more steps", ["train", "--out", "{R}", "--resume", "auto", "--set", "train.steps=10", *QUIET],
         2, "use --extend-to 10", True),
    Case("resume a finished run", ["train", "--preset", "micro", "--out", "{R}", *XCLIP, "--resume", "auto", *QUIET],
         0, "already finished at step 6", True),
    Case("resume a finished run, allowed change", ["train", "--out", "{R}", "--resume", "auto",
                                                   "--set", "train.log_every=1", *QUIET],
         0, "already finished at step 6", True),
    Case("resume with the run's own config", ["train", "--out", "{R}", "--resume", "auto",
                                              "--set", "train.log_every=1", *QUIET],
         0, "", False, lines=0, prepare=_drop_last_checkpoint, check=_resumed_with_its_own_config),
    Case("extend a finished run", ["train", "--out", "{R}", "--extend-to", "10", *QUIET], 0,
         "lr follows the run's 6-step schedule", False, check=_extended),
    Case("extend below the run's steps", ["train", "--out", "{R}", "--extend-to", "4", *QUIET], 2,
         "cannot be shortened", True),
    Case("extend a non-run", ["train", "--out", "{R}/sub", "--extend-to", "10", *QUIET], 2,
         "holds no run to extend", True),
    Case("export into the run folder", ["export", "--checkpoint", "{R}", "--hf", "{R}"], 2,
         "is a training run", True),
    Case("export over the run's model, forced", ["export", "--checkpoint", "{R}", "--hf", "{R}/model", "--force"], 2,
         "is the model of a training run", True),
    Case("export over a non-empty directory", ["export", "--checkpoint", "{R}", "--hf", "{R}/hf-old"], 2,
         "pass --force", True, prepare=_old_export_folder),
    Case("export over a non-empty directory, forced",
         ["export", "--checkpoint", "{R}", "--hf", "{R}/hf-old", "--force"], 0,
         "", False, lines=None, prepare=_old_export_folder, check=_exported_over),
    Case("ProtoCLIP: train into its run", ["train", "--preset", "protoclip-tiny", "--out", "{R}", *PROTO, *QUIET],
         2, "already holds a run", True, base="protoclip"),
    Case("ProtoCLIP: --force clears episodes.jsonl",
         ["train", "--preset", "protoclip-tiny", "--out", "{R}", *PROTO, "--set", "train.steps=2", "--force", *QUIET],
         0, "episodes.jsonl", False, base="protoclip", check=_proto_started_over),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_no_command_destroys_a_run(case: Case, runs, tmp_path, capsys):
    run = tmp_path / "R"
    shutil.copytree(runs[case.base], run)
    if case.prepare:
        case.prepare(run)
    before = hashes(run)
    code = main([a.replace("{R}", str(run)) for a in case.argv])
    err = capsys.readouterr().err
    assert code == case.code, err
    assert "Traceback" not in err and case.needle in err, err
    if case.lines is not None:  # the CLI's own messages ("nclip: ..."), not a run's start-up block and log lines
        assert len([line for line in err.splitlines() if line.startswith("nclip:")]) == case.lines, err
    if case.unchanged:
        assert hashes(run) == before
    if case.check:
        case.check(run, before)


@pytest.mark.slow
def test_a_failed_start_leaves_nothing_behind(tmp_path, capsys):
    """A run that cannot start (here: missing data) writes nothing, so fixing it needs no --force."""
    run = tmp_path / "R"
    args = ["train", "--preset", "micro", "--out", str(run), *QUIET, "--set", "data.source=csv",
            "--set", "data.csv=/nonexistent/pairs.csv"]
    assert main(args) == 2 and "/nonexistent/pairs.csv" in capsys.readouterr().err
    assert not run.exists() or not any(run.iterdir())


# ---- the policy itself -----------------------------------------------------------------------------


def test_resume_policy_keys():
    from nclip.train.rundir import may_change_on_resume

    local, shards = resolve("micro"), resolve("micro", ["data.source=webdataset", "data.shards=/x/{0..1}.tar"])
    for key in ("train.log_every", "train.threads", "eval.samples", "data.num_workers"):
        assert may_change_on_resume(key, local), key
    for key in ("train.steps", "train.lr", "seed", "model.vision.width", "train.device", "data.exact_resume"):
        assert not may_change_on_resume(key, local), key
    assert not may_change_on_resume("data.num_workers", shards)  # one shard stream per worker: the order


def test_extension_schedule_is_the_original_then_min_lr():
    from nclip.train.optim import lr_at

    run = resolve("micro", ["train.steps=20"]).train
    extended = resolve("micro", ["train.steps=40", "train.schedule_steps=20"]).train
    assert [lr_at(s, extended) for s in range(20)] == [lr_at(s, run) for s in range(20)]
    assert [lr_at(s, extended) for s in range(20, 40)] == [run.min_lr] * 20


# ---- under torchrun every rank takes rank 0's decision ----------------------------------------------


def _decisions_on_every_rank(rank, world, run):
    from nclip.errors import NclipError

    cfg = resolve(str(Path(run) / "config.yaml"))
    out = []
    for kwargs, c in (({}, cfg), ({"resume": True}, cfg.model_copy(update={"seed": 1}))):
        try:
            train(c, run, progress=False, evaluate=False, **kwargs)
            out.append("trained")
        except NclipError as e:
            out.append(str(e))
    out.append(train(cfg, run, resume=True, progress=False, evaluate=False).already_finished)
    return out


@pytest.mark.slow
def test_every_rank_takes_the_same_decision(runs, tmp_path):
    from distributed_utils import run_ranks

    run = tmp_path / "R"
    shutil.copytree(runs["xclip"], run)
    before = hashes(run)
    got = run_ranks(_decisions_on_every_rank, world_size=2, args=(str(run),))
    assert got[0] == got[1]
    assert "already holds a run" in got[0][0] and "seed: 0 -> 1" in got[0][1] and got[0][2] is True
    assert hashes(run) == before
