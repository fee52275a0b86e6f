"""The scripts in examples/ run as written (at micro settings): train on a CSV and evaluate it, then
classify a folder of images zero-shot with the run. Each runs as ``python examples/SCRIPT ARGS``
would (``runpy`` as ``__main__``, with that ``sys.argv``), in this process to save two start-ups."""

import runpy
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _run(script: str, *args, capsys, monkeypatch) -> str:
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / script), *map(str, args)])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    out, err = capsys.readouterr()
    assert done.value.code == 0, err[-2000:]
    return out


@pytest.mark.slow
def test_train_on_csv_then_zero_shot_folder(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    out = _run("train_on_csv.py", "--out", run, "--preset", "micro", "--steps", "4", "--pairs", "24",
               "--set", "train.batch_size=8", "--set", "train.checkpoint_every=4", capsys=capsys,
               monkeypatch=monkeypatch)
    assert (run / "model" / "model.safetensors").is_file()
    assert "retrieval/test/i2t@1:" in out and (run / "eval" / "results.json").is_file()

    test_images = tmp_path / "run.data" / "test"  # the demo CSV's held-out scenes
    out = _run("zero_shot_folder.py", run, test_images, "circle", "star", "square", "--device", "cpu",
               capsys=capsys, monkeypatch=monkeypatch)
    lines = out.strip().splitlines()
    assert len(lines) == len(list(test_images.glob("*.png"))) == 10
    assert all(line.split("\t")[1] in ("circle", "star", "square") for line in lines)
