"""What a run tells its user: the start-up block, one line per log step with --no-progress, and
TensorBoard scalars (train.tensorboard) equal to metrics.jsonl's."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from nclip.cli import main
from nclip.config import resolve
from nclip.train.logbook import main_terms, step_line

from conftest import micro_sizes

HAVE_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
OVERRIDES = micro_sizes() + ["train.steps=4", "train.batch_size=8", "train.warmup_steps=1", "train.log_every=2",
                             "train.checkpoint_every=4", "train.threads=1", "data.train_length=64"]


def test_step_line_names_step_loss_terms_and_speed():
    row = {"step": 20, "lr": 1e-3, "loss": 1.5, "clip/loss": 2.0, "clip/acc_i2t": 0.1, "nclip/L_CE": 5.25,
           "nclip/usage": 0.3, "grad_norm": 1.0, "samples_per_s": 123.4}
    assert main_terms(row) == ["clip/loss", "nclip/L_CE"]  # losses, not statistics
    assert step_line(row, 100) == ("step 20/100  loss 1.5000  clip/loss 2.0000  nclip/L_CE 5.2500  lr 0.001  "
                                   "123 samples/s")
    assert step_line({**row, "data_wait_s": 0.0125}, 100).endswith("123 samples/s  data wait 12.5 ms/step")
    evaluated = {**row, "eval/zeroshot/d-shape/top1": 0.25, "eval/zeroshot/d-colour/top1": 0.5,
                 "eval/zeroshot/d-count/top1": 0.75, "eval/retrieval/d/i2t@1": 0.1,
                 "eval/retrieval/d/mean_recall": 0.125, "eval_s": 2.25}
    assert step_line(evaluated, 100).endswith("123 samples/s (eval 2.2 s)  zeroshot/d-shape 0.250  "
                                              "zeroshot/d-colour 0.500  retrieval/d/mean_recall 0.125")


@pytest.mark.slow
def test_startup_block_and_a_line_per_log_step(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "--preset", "micro", "--out", str(out), "--no-progress", "--no-eval"]
    evals = ["train.eval_every=4", "train.eval_samples=16",  # evaluation while training at step 4
             f"train.tensorboard={str(HAVE_TENSORBOARD).lower()}"]
    args += [x for o in OVERRIDES + evals for x in ("--set", o)]
    assert main(args) == 0
    err = capsys.readouterr().err.splitlines()
    block = {line.split()[0]: line for line in err[1:13]}
    assert err[0] == "nclip train"
    assert "micro" in block["preset"]
    assert ("xclip (λ1=0.5, λ2=1.5, L_CLIP reduction=mean, λ_CLIP=0.2, λ_nCLIP=1.0, nCLIP start=0, nCLIP ramp=0)"
            in block["objective"])
    assert "vit, width 32, 1 layers, patch 4 (" in block["image"] and "params)" in block["image"]
    assert "transformer, width 32, 1 layers (" in block["text"] and "params)" in block["text"]
    assert "synthetic, 64 samples, 16 px" in block["data"]
    assert "cpu, 1 rank, auto (fp32" in block["device"]
    assert block["threads"].split(None, 1)[1] == "1 (train.threads)"
    assert block["steps"].split()[1] == "4," and "8 pairs per step" in block["batch"]
    assert block["output"].endswith(str(out))
    assert "every 4 steps: zero-shot and retrieval (clip head) on 16 images of synthetic" in block["eval"]
    lines = [line for line in err if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/4", "4/4"]
    assert all("loss " in line and "nclip/L_CE " in line and "samples/s" in line and "data wait " in line
               for line in lines)
    assert "zeroshot/synthetic-shape " in lines[1] and "retrieval/synthetic/mean_recall " in lines[1]
    assert "eval " not in lines[0] and "samples/s (eval " in lines[1]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["data_wait_s"] >= 0 for r in rows)  # the mean host wait for a batch, per step
    assert "eval_s" not in rows[0] and rows[1]["eval_s"] > 0 and "eval/zeroshot/synthetic-shape/top1" in rows[1]

    if not HAVE_TENSORBOARD:
        return
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    for key in ("loss", "lr", "nclip/L_CE", "clip/loss", "samples_per_s", "data_wait_s", "grad_norm",
                "eval/zeroshot/synthetic-shape/top1", "eval/retrieval/synthetic/mean_recall", "eval_s"):
        got = [(e.step, e.value) for e in events.Scalars(key)]
        assert got == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in rows if key in r], key


def test_tensorboard_without_the_package_is_a_one_line_config_error(monkeypatch, tmp_path, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(Exception, match=r"pip install nclip\[tensorboard\]"):
        resolve("micro", ["train.tensorboard=true"])
    assert main(["train", "--preset", "micro", "--out", str(tmp_path / "r"), "--set", "train.tensorboard=true"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "train.tensorboard" in err and "pip install nclip[tensorboard]" in err


def test_an_image_only_run_counts_images_per_step():
    from nclip.models import build_model
    from nclip.train.launch import DistContext
    from nclip.train.logbook import startup_block
    from nclip.train.rundir import RunInfo

    cfg = resolve("micro", micro_sizes() + ["objective.name=cmsf"])
    info = RunInfo(cfg, Path("r"), DistContext())
    lines = startup_block(info, build_model(cfg), None, None, "micro").splitlines()[1:]
    block = {line.split()[0]: line for line in lines}
    assert f"{cfg.train.batch_size} images per step" in block["batch"] and "none" in block["text"]
