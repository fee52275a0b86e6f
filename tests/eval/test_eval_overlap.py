"""Evaluating on images the run trained on says so in one warning; the log names the folder an
ImageFolder split was read from (issue 36.7)."""

from __future__ import annotations

import pytest
from benchmark_layouts import write_imagefolder

from nclip.cli import main
from nclip.config import resolve

from conftest import micro_sizes

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _model(tmp_path, folder):
    """A model with random weights whose config says it trained on ``data.folder`` (no training
    needed: the warning reads the config's source)."""
    import torch

    from nclip.models import build_model
    from nclip.models.io import save_model

    torch.manual_seed(0)
    cfg = resolve("micro", micro_sizes() + ["data.source=folder", f"data.folder={folder}", "objective.name=clip"])
    return save_model(build_model(cfg, pretrained_text=False), cfg, tmp_path / "model")


@pytest.mark.parametrize("trained_on, warned", [("val", True), ("train", False)])
def test_zero_shot_on_the_training_folder_warns(tmp_path, capsys, trained_on, warned):
    root = write_imagefolder(tmp_path / "bench", per_class=2, splits=("val", "train"))
    model = _model(tmp_path, root / trained_on)
    assert main(["eval", "--checkpoint", str(model), "--dataset", f"imagefolder:{root / 'val'}",
                 "--tasks", "zeroshot", "--out", str(tmp_path / "ev"), "--no-report", "--no-cache"]) == 0
    err = capsys.readouterr().err
    n = len(list((root / "val").rglob("*.png")))
    warning = (f"nclip: warning: {n} of the {n} test images of bench are images this run trained on "
               f"(data.folder {root / trained_on}): their zero-shot, retrieval and probe numbers are not held-out")
    assert (warning in err) == warned, err
    assert f"extracting bench/test ({(root / 'val').resolve()}): {n} images" in err
