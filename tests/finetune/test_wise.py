"""`nclip finetune --wise`: WiSE-FT mixes of the zero-shot start (α 0: the cosine classifier at step 0,
i.e. zero-shot classification) and the fine-tuned network (α 1: the reported fine-tuned numbers)."""

import json

import pytest
import torch

from nclip.cli import main
from nclip.config import resolve
from nclip.finetune.settings import FinetuneSettings

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

FAST = ["--epochs", "2", "--lrs", "3e-3", "--batch-size", "32", "--quiet", "--no-report"]


def _model_dir(tmp_path, objective="xclip"):
    """A digits-sized micro model directory with random weights (as tests/finetune/test_finetune.py's)."""
    from nclip.models import build_model
    from nclip.models.io import save_model

    cfg = resolve("micro", ["data.source=digits", "data.image_size=16", "model.vision.layers=2", "train.threads=1",
                            f"objective.name={objective}"])
    torch.manual_seed(0)
    return save_model(build_model(cfg, pretrained_text=True), cfg, tmp_path / objective / "model")


def _net(model_dir, classifier):
    from nclip.data.digits import DIGIT_NAMES, DIGIT_TEMPLATES
    from nclip.data.types import LabelKind
    from nclip.eval.checkpoint import resolve_checkpoint
    from nclip.finetune.network import build_net

    ck = resolve_checkpoint(model_dir)
    return ck, build_net(ck, classifier, LabelKind(DIGIT_NAMES, DIGIT_TEMPLATES), torch.device("cpu"))


def test_mixes_run_from_the_start_network_to_the_tuned_one(tmp_path):
    from nclip.finetune.data import prepare
    from nclip.finetune.loop import predict
    from nclip.finetune.wise import table_text, wise_table

    model_dir = _model_dir(tmp_path)
    ck, tuned = _net(model_dir, "cosine")
    torch.manual_seed(3)
    with torch.no_grad():  # a "fine-tuned" network: every weight moved
        for p in tuned.parameters():
            p.add_(0.5 * torch.randn_like(p))
    prep = prepare(ck.cfg, FinetuneSettings(dataset="digits", test_samples=60, train_samples=60))
    rows = wise_table(lambda: _net(model_dir, "cosine")[1], tuned, (0.0, 0.5, 1.0), prep)
    start = predict(_net(model_dir, "cosine")[1], prep.test_pixels).argmax(1)
    end = predict(tuned, prep.test_pixels).argmax(1)
    assert rows[0]["top1"] == pytest.approx((start == prep.test_labels).float().mean().item())
    assert rows[2]["top1"] == pytest.approx((end == prep.test_labels).float().mean().item())
    assert [r["alpha"] for r in rows] == [0.0, 0.5, 1.0] and {"top5", "mean_per_class", "val_top1"} <= set(rows[1])
    text = table_text(rows)
    assert text.splitlines()[0].startswith("WiSE-FT alpha") and len(text.splitlines()) == 4


@pytest.mark.parametrize("argv, needle", [
    (["--wise", "0,1.5"], "finetune: wise.1: Input should be less than or equal to 1"),
    (["--wise", "zero"], "finetune: --wise: expected comma-separated numbers"),
    (["--wise", "0,1", "--classifier", "linear"], "--wise needs the cosine classifier"),
    (["--wise", "0,1", "--fraction", "1"], "--wise needs the cosine classifier"),  # auto → linear at fraction 1
])
def test_bad_wise_inputs_are_one_line_errors(tmp_path, capsys, argv, needle):
    model = _model_dir(tmp_path, "xclip")
    code = main(["finetune", "--checkpoint", str(model), "--out", str(tmp_path / "ft"), *FAST, *argv])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "ft" / "sweep").exists()


@pytest.mark.slow
def test_wise_end_to_end_tabulates_zero_shot_to_fine_tuned(tmp_path, capsys):
    from nclip.eval.runner import run_eval

    model = _model_dir(tmp_path)
    out = tmp_path / "ft"
    assert main(["finetune", "--checkpoint", str(model), "--out", str(out), "--fraction", "0.1", "--epochs", "1",
                 "--lrs", "3e-3", "--batch-size", "32", "--quiet", "--wise", "0,0.5,1"]) == 0
    printed = capsys.readouterr().out
    doc = json.loads((out / "results.json").read_text())
    r, rows = doc["results"], doc["config"]["wise"]
    assert [row["alpha"] for row in rows] == [0, 0.5, 1]
    # α = 1: the fine-tuned network the command reports; α = 0: zero-shot classification of the checkpoint
    assert rows[2]["top1"] == r["finetune/digits-digit/top1"]
    assert rows[2]["val_top1"] == r["finetune/digits-digit/val_top1"]
    zero_shot = run_eval(model, out=None, tasks=("zeroshot",), datasets=("digits",), head="clip", cache_dir=None)
    assert rows[0]["top1"] == pytest.approx(zero_shot["results"]["zeroshot/digits-digit/top1"], abs=1e-6)
    assert "WiSE-FT alpha" in printed and len([x for x in printed.splitlines() if x.strip().startswith("0.5 ")]) == 1
    assert "WiSE-FT, test top-1" in (out / "report.html").read_text()
