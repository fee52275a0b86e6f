"""The CLI end to end on a micro run, and its one-line errors."""

import json
import subprocess
import sys

import pytest

from nclip.cli import main


@pytest.mark.slow
def test_train_end_to_end(tmp_path, micro_overrides, capsys):
    out = tmp_path / "run"
    args = ["train", "--preset", "micro", "--out", str(out), "--no-progress"]
    for o in micro_overrides:
        args += ["--set", o]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "zeroshot/shape/top1" in printed and "retrieval/i2t@1" in printed

    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [2, 4, 6]
    for key in ("step", "lr", "loss", "logit_scale", "samples_per_s", "clip/loss", "nclip/L_CE",
                "nclip/L_EH", "nclip/L_HE", "nclip/L_KL"):
        assert key in lines[-1], key
    ev = json.loads((out / "eval.json").read_text())
    for key in ("zeroshot/shape/top1", "zeroshot/shape/chance", "retrieval/i2t@1", "retrieval/t2i@1"):
        assert 0.0 <= ev[key] <= 1.0
    assert (out / "config.yaml").is_file()
    assert (out / "model" / "model.safetensors").is_file()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000003", "step_00000006"]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["train", "--out", "X", "--set", "train.stepz=3"], "train.stepz: unknown key"),
        (["train", "--out", "X", "--preset", "missing-preset"], "unknown preset"),
        (["train"], "--out"),
        (["export", "--checkpoint", "/nonexistent", "--hf", "X"], "no nclip model found"),
        (["frobnicate"], "invalid choice"),
    ],
)
@pytest.mark.slow
def test_user_errors_are_one_line_exit_2(argv, needle, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "nclip", *argv], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_version(capsys):
    from nclip import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"nclip {__version__}"
