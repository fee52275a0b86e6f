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


def test_zero_shot_folder_reads_a_folder_per_class(tmp_path, capsys, monkeypatch, micro_overrides):
    """A class-folder tree (DIR/<class>/<image>, as `nclip eval --dataset folder:DIR` reads) is searched
    recursively; the classes default to the sub-folders' names and the accuracy is printed (issue 28.9)."""
    import numpy as np
    import torch
    from PIL import Image

    from nclip.config import resolve
    from nclip.models import build_model
    from nclip.models.io import save_model

    cfg = resolve("micro", micro_overrides)
    torch.manual_seed(0)
    model_dir = save_model(build_model(cfg, pretrained_text=False).eval(), cfg, tmp_path / "run" / "model")
    rng = np.random.default_rng(0)
    for cls, n in (("circle", 2), ("star", 3)):
        (tmp_path / "pets" / cls).mkdir(parents=True)
        for i in range(n):
            pixels = rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(tmp_path / "pets" / cls / f"{i}.png")

    out = _run("zero_shot_folder.py", model_dir.parent, tmp_path / "pets", "--device", "cpu", capsys=capsys,
               monkeypatch=monkeypatch)
    lines = [line.split("\t") for line in out.strip().splitlines()]
    assert [name for name, *_ in lines] == ["circle/0.png", "circle/1.png", "star/0.png", "star/1.png", "star/2.png"]
    assert all(best in ("circle", "star") and "circle=" in scores and "star=" in scores for _, best, scores in lines)

    monkeypatch.setattr(sys, "argv", ["zero_shot_folder.py", str(model_dir.parent), str(tmp_path / "pets"),
                                      "circle", "star", "square", "--device", "cpu"])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(EXAMPLES / "zero_shot_folder.py"), run_name="__main__")
    out, err = capsys.readouterr()
    assert done.value.code == 0 and len(out.strip().splitlines()) == 5 and "square=" in out
    right = sum(line.split("\t")[0].split("/")[0] == line.split("\t")[1] for line in out.strip().splitlines())
    assert err.strip() == f"accuracy against the folder names: {right}/5 = {right / 5:.3f}"
