"""`nclip eval --tasks classifier`: the pre-training classifier's readout of xent (its linear layer)
and frzproto (the nearest frozen prototype), CMSF Sec. 2.1.3, against a hand computation on the
extracted features of a micro checkpoint."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from nclip.cli import main
from nclip.config import resolve
from nclip.models import build_model
from nclip.models.io import save_model
from nclip.objectives import functional

from conftest import MICRO_OVERRIDES

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
MICRO = list(MICRO_OVERRIDES)
SMALL = ["--samples", "40", "--train-samples", "60", "--quiet"]
SIZES = ["data.source=digits", "model.supcon_hidden=32", "model.supcon_dim=16", "seed=3"]


def _eval(path: Path, out: Path) -> tuple[dict, dict]:
    assert main(["eval", "--checkpoint", str(path), "--out", str(out), "--dataset", "digits",
                 "--tasks", "classifier", *SMALL]) == 0
    doc = json.loads((out / "results.json").read_text())
    (entry,) = [f for f in Path(doc["cache"]["dir"]).glob(f"{doc['checkpoint']['weights_sha256'][:16]}/digits-test-*")]
    return doc, load_file(str(entry))


def _evaluate(tmp_path: Path, objective: str) -> tuple[dict, object, dict]:
    """A micro checkpoint trained 40 steps on digits (an untrained one gives every image the same
    class, where a wrong classifier could score the same), evaluated by `nclip eval`."""
    from nclip.eval.checkpoint import resolve_checkpoint
    from nclip.train.loop import train

    cfg = resolve("micro", MICRO + [f"objective.name={objective}", *SIZES, "train.steps=40", "train.batch_size=32",
                                    "train.lr=3e-3", "train.checkpoint_every=40"])
    train(cfg, tmp_path / "run", progress=False, evaluate=False)
    doc, test = _eval(tmp_path / "run", tmp_path / "eval")
    return doc, resolve_checkpoint(tmp_path / "run").load("cpu"), test


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["xent", "frzproto"])
def test_readout_is_argmax_over_the_pretraining_classifier(tmp_path, objective):
    doc, model, test = _evaluate(tmp_path, objective)
    top1 = doc["results"]["classifier/digits-digit/top1"]
    assert 0.0 <= top1 <= 1.0 and "classifier" not in doc["skipped"]
    with torch.no_grad():
        f = test["image.features"]
        if objective == "xent":
            scores = model.heads["xent"].image(f)
        else:  # the nearest of the prototypes the objective trained with (seed 3, 10 digits, D 16)
            scores = F.normalize(model.heads["supcon"].image(f), dim=-1) @ functional.frozen_prototypes(10, 16, 3).T
    y = test["label.digit"]
    assert scores.argmax(-1).unique().numel() >= 3  # the check below can tell classifiers apart
    assert top1 == pytest.approx(float((scores.argmax(-1) == y).float().mean()), abs=1e-6)


def test_an_objective_without_a_classifier_is_skipped_with_a_reason(tmp_path):
    cfg = resolve("micro", MICRO + ["objective.name=supcon", *SIZES])
    path = save_model(build_model(cfg, pretrained_text=True), cfg, tmp_path / "model")
    assert main(["eval", "--checkpoint", str(path), "--out", str(tmp_path / "e"), "--dataset", "digits",
                 "--tasks", "classifier", *SMALL]) == 0
    doc = json.loads((tmp_path / "e" / "results.json").read_text())
    assert not doc["results"] and "learns no classifier" in doc["skipped"]["classifier"]
