"""What `nclip eval --checkpoint` (and `nclip.load`) reads from a run that has checkpoints but no
model/ (stopped before its end, or still training): its newest checkpoint; and where that cannot
be, what exactly is missing (issue 28.11)."""

import shutil

import pytest
import torch

from nclip.config import resolve, to_yaml
from nclip.errors import NclipError
from nclip.eval.checkpoint import resolve_checkpoint
from nclip.models import build_model
from nclip.models.io import WEIGHTS, save_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture
def run_without_model(tmp_path, micro_overrides):
    """RUN with config.yaml and checkpoints step 2 and 4 (model.safetensors + state.pt), no model/."""
    cfg = resolve("micro", micro_overrides)
    torch.manual_seed(0)
    weights = save_model(build_model(cfg, pretrained_text=False), cfg, tmp_path / "saved") / WEIGHTS
    run = tmp_path / "run"
    for step in (2, 4):
        d = run / "checkpoints" / f"step_{step:08d}"
        d.mkdir(parents=True)
        shutil.copy(weights, d / WEIGHTS)
        (d / "state.pt").write_bytes(b"")  # not read by an evaluation
    (run / "config.yaml").write_text(to_yaml(cfg))
    return run


def test_a_run_without_model_evaluates_its_newest_checkpoint(run_without_model):
    ck = resolve_checkpoint(run_without_model)
    assert ck.path == run_without_model / "checkpoints" / "step_00000004" and ck.run_dir == run_without_model
    assert ck.cfg.objective.name == "xclip"
    assert not ck.load("cpu").training


def test_what_is_missing_is_said(run_without_model):
    (run_without_model / "config.yaml").unlink()
    with pytest.raises(NclipError, match=r"step_00000004 holds model.safetensors but no config.json, and "
                                         r".*run/config.yaml \(the config of a training checkpoint's run\)"):
        resolve_checkpoint(run_without_model)
    for step in run_without_model.glob("checkpoints/step_*"):
        shutil.rmtree(step)
    with pytest.raises(NclipError, match=r"no nclip checkpoint .*checkpoints holds no step_N with model\.safetensors"):
        resolve_checkpoint(run_without_model)
