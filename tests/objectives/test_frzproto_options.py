"""FrzProto's paper settings (issue 35 §3): the paper-scale preset's 2048-wide output (App. A.1) and
Tab. 2c's "FC" head (one linear layer instead of the MLP)."""

from __future__ import annotations

import json

import pytest
import torch

from nclip.cli import main
from nclip.config import resolve
from nclip.errors import NclipError
from nclip.heads.layers import SupconMLP
from nclip.models.dual_encoder import build_model
from nclip.objectives import build_objective

SIZES = ["data.source=digits", "model.supcon_hidden=32", "model.supcon_dim=16", "train.threads=1",
         "train.log_every=1", "train.batch_size=16"]


def test_paper_scale_frzproto_is_2048_wide_and_cpu_presets_stay_small():
    cfg = resolve("cmsf-rn50-in1k", ["objective={name: frzproto, num_classes: 1000}"])
    assert cfg.model.supcon_dim == 2048 and cfg.model.supcon_hidden == 2048  # 2048 -> 2048 -> 2048
    assert build_objective(cfg.objective, cfg).prototypes.shape == (1000, 2048)
    assert resolve("cmsf-tiny", ["objective={name: frzproto}"]).model.supcon_dim == 128


@pytest.mark.parametrize("head", ["mlp", "fc"])
def test_head_option_builds_the_mlp_or_one_linear_layer(head):
    cfg = resolve("micro", ["objective.name=frzproto", *SIZES, f"objective.head={head}"])
    model = build_model(cfg, pretrained_text=False)
    h, width = model.heads["supcon"].image, model.vision.width
    if head == "fc":
        assert isinstance(h, torch.nn.Linear) and h.weight.shape == (16, width)
        assert sum(p.numel() for p in h.parameters()) == width * 16 + 16
    else:
        assert isinstance(h, SupconMLP)
        assert sum(p.numel() for p in h.parameters()) == width * 32 + 32 + 2 * 32 + 32 * 16 + 16
    model.eval()
    assert h(model.vision(torch.randn(4, 3, cfg.data.image_size, cfg.data.image_size))).shape == (4, 16)


def test_bad_head_is_one_line():
    with pytest.raises(NclipError, match="head") as e:
        resolve("micro", ["objective.name=frzproto", *SIZES, "objective.head=conv"])
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_fc_head_trains_two_steps(tmp_path):
    args = ["train", "--preset", "micro", "--out", str(tmp_path / "r"), "--no-progress", "--no-eval"]
    for o in ["objective.name=frzproto", "objective.head=fc", *SIZES, "train.steps=2"]:
        args += ["--set", o]
    assert main(args) == 0
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["frzproto/loss"] for r in rows if "frzproto/loss" in r]
    assert len(losses) == 2 and all(0 <= v <= 4 for v in losses)  # 2 - 2cos lies in [0, 4]
