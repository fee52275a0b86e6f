"""`--force` replaces only what it may replace (docs/runs.md, "What --force replaces"): no command
writes over a training run, a run's checkpoints/, a checkpoint or a folder that holds runs, --force
or not, and nothing of them is touched; with --force a command replaces its own earlier output
only, never another command's or a model it did not write."""

import hashlib
import json
import os
from pathlib import Path

import pytest

from nclip.cli import main
from nclip.config import resolve
from nclip.errors import NclipError
from nclip.overwrite import EMBED, EVAL, EXPORT, FINETUNE, MERGE, OUTPUTS, SWEEP, check_output_folder
from nclip.train.checkpoint import list_checkpoints
from nclip.train.loop import train

from conftest import MICRO_OVERRIDES

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """runs/: a folder holding one finished micro run, runs/r, with a checkpoint."""
    folder = tmp_path_factory.mktemp("runs")
    train(resolve("micro", [*MICRO_OVERRIDES, "train.steps=3"]), folder / "r", progress=False, evaluate=False)
    return folder


def _snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (and so the list of them), by relative path."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _targets(runs: Path) -> dict[str, Path]:
    run = runs / "r"
    return {"run": run, "checkpoints": run / "checkpoints", "step_N": list_checkpoints(run)[-1], "runs": runs}


def _command(name: str, run: Path, out: Path) -> list[str]:
    r, o = str(run), str(out)
    return {
        "export --hf": ["export", "--checkpoint", r, "--hf", o],
        "export --onnx": ["export", "--checkpoint", r, "--onnx", o],
        "export --open-clip": ["export", "--checkpoint", r, "--open-clip", o],
        "merge": ["merge", r, r, "--alpha", "0.5", "--out", o],
        "eval": ["eval", "--checkpoint", r, "--out", o, "--tasks", "zeroshot", "--samples", "16"],
        "embed": ["embed", "synthetic", "--checkpoint", r, "--out", o, "--samples", "8", "--no-progress"],
        "finetune": ["finetune", "--checkpoint", r, "--out", o, "--epochs", "1", "--quiet"],
        "sweep": ["sweep", "--preset", "micro", "--grid", "seed=[0]", "--out", o],
    }[name]


COMMANDS = ["export --hf", "export --onnx", "export --open-clip", "merge", "eval", "embed", "finetune", "sweep"]


@pytest.mark.parametrize("target", ["run", "checkpoints", "step_N", "runs"])
@pytest.mark.parametrize("command", COMMANDS)
def test_force_never_writes_over_a_run_or_a_checkpoint(command, target, runs, capsys):
    before = _snapshot(runs)
    out = _targets(runs)[target]
    assert main([*_command(command, runs / "r", out), "--force"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert str(out) in err and ("training run" in err or "training checkpoint" in err), err
    assert _snapshot(runs) == before


# ---- the guard on folders as each command leaves them ---------------------------------------------------

def _folder(root: Path, name: str, files: dict[str, str]) -> Path:
    folder = root / name
    for rel, text in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)
    return folder


# what each command leaves in its folder (the files that tell it apart, and some of the rest)
LEFT_BY = {
    EXPORT: {"nclip_export.json": '{"format": "hf"}', "config.json": "{}", "model.safetensors": "w",
             "preprocessor_config.json": "{}"},
    MERGE: {"merge.json": "{}", "config.json": "{}", "model.safetensors": "w"},
    FINETUNE: {"finetune.json": "{}", "results.json": "{}", "report.html": "", "model/model.safetensors": "w",
               "sweep/lr_0/best/model.safetensors": "w"},
    EVAL: {"results.json": "{}", "report.html": ""},
    EMBED: {"manifest.json": "{}", "images-00000.npy": "x", "index.faiss": "x"},
    SWEEP: {"sweep.json": "{}", "table.md": "", "runs/a/config.yaml": "seed: 0\n", "runs/a/metrics.jsonl": "{}\n"},
}


@pytest.mark.parametrize("writer", OUTPUTS, ids=[o.command for o in OUTPUTS])
def test_each_command_replaces_its_own_output_and_no_other(writer, tmp_path):
    mine = _folder(tmp_path, "mine", {**LEFT_BY[writer], "notes.txt": "the user's"})
    check_output_folder(mine, "--out", writer)  # its own earlier output, beside a file of the user's
    for other in OUTPUTS:
        if other is not writer:
            theirs = _folder(tmp_path, f"by-{other.command.split()[1]}", LEFT_BY[other])
            with pytest.raises(NclipError, match=rf"is {other.command}'s output; {writer.command} --force replaces "
                                                 rf"only {writer.own}"):
                check_output_folder(theirs, "--out", writer)
            nested = tmp_path / "nested" / other.command.split()[1]
            _folder(nested, "deep/below", LEFT_BY[other])
            with pytest.raises(NclipError, match=rf"holds {other.command}'s output \({nested / 'deep/below'}\)"):
                check_output_folder(nested, "--out", writer)


def test_a_model_that_nclip_did_not_write_is_never_replaced(tmp_path):
    """A transformers or open_clip model (downloaded, or exported before exports were marked) has an
    export's layout but no nclip_export.json: export --force must not replace it."""
    hf = _folder(tmp_path, "clip-b32", {"config.json": "{}", "model.safetensors": "w",
                                        "preprocessor_config.json": "{}"})
    oc = _folder(tmp_path, "laion", {"open_clip_config.json": "{}", "open_clip_model.safetensors": "w"})
    for folder in (hf, oc):
        with pytest.raises(NclipError, match=f"--hf {folder} is a model;"):
            check_output_folder(folder, "--hf", EXPORT)
    loose = _folder(tmp_path, "weights", {"RN50.pt": "w"})
    with pytest.raises(NclipError, match=r"holds a checkpoint file \(.*RN50.pt\)"):
        check_output_folder(loose, "--out", EVAL)
    with pytest.raises(NclipError, match=r"lies inside a model .*clip-b32"):
        check_output_folder(hf / "sub", "--out", EMBED)


def test_beside_a_runs_files_is_allowed_inside_them_is_not(runs, tmp_path):
    run = runs / "r"
    check_output_folder(run / "eval", "--out", EVAL)  # docs: nclip eval --checkpoint RUN --out RUN/eval
    check_output_folder(run / "embed", "--out", EMBED)
    for inside, says in [(run / "model", f"is the model of a training run {run}"),
                         (run / "model-raw", f"is the model-raw of a training run {run}"),
                         (run / "checkpoints" / "new", f"lies inside the checkpoints of a training run {run}"),
                         (run / "model" / "x", f"lies inside a model {run / 'model'}")]:
        with pytest.raises(NclipError, match=says):
            check_output_folder(inside, "--out", MERGE)
    check_output_folder(tmp_path / "step_2" / "eval", "--out", EVAL)  # a folder of the user's, not a checkpoint
    link = tmp_path / "link"
    link.symlink_to(run, target_is_directory=True)
    with pytest.raises(NclipError, match=f"--out {link} is a training run"):
        check_output_folder(link, "--out", SWEEP)


def test_an_export_marks_its_folder_and_force_replaces_it(runs, tmp_path, capsys):
    out = tmp_path / "onnx"
    assert main(["export", "--checkpoint", str(runs / "r"), "--onnx", str(out)]) == 0, capsys.readouterr().err
    assert json.loads((out / "nclip_export.json").read_text()) == {"format": "onnx"}
    assert main(["export", "--checkpoint", str(runs / "r"), "--hf", str(out), "--force"]) == 0, \
        capsys.readouterr().err
    assert json.loads((out / "nclip_export.json").read_text()) == {"format": "hf"}
    assert not any(p.suffix == ".onnx" for p in out.iterdir()) and not os.path.exists(out / "tokenizer")


def test_a_tree_too_large_to_check_is_refused(tmp_path, monkeypatch):
    import nclip.overwrite

    monkeypatch.setattr(nclip.overwrite, "MAX_FOLDERS", 3)
    big = _folder(tmp_path, "big", {f"d{i}/notes.txt": "mine" for i in range(4)})
    with pytest.raises(NclipError, match=r"holds more than 3 folders, too many to check"):
        check_output_folder(big, "--out", EVAL)
    check_output_folder(_folder(tmp_path, "small", {"d0/notes.txt": "mine"}), "--out", EVAL)
