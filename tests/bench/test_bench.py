"""nclip bench: the command runs every row at --quick size and writes its JSON (docs/performance.md)."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import pytest
from bench_helpers import count_builds, scratch_home

from nclip.bench import loop_overhead, runner, stages
from nclip.bench.budget import Sizes
from nclip.bench.report import Report
from nclip.cli import main
from nclip.config import resolve


def test_an_unknown_comparison_is_one_line_and_exit_2(capsys):
    assert main(["bench", "--compare", "timm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--compare" in err[0]


def test_quick_sizes_are_smaller_than_the_cpu_defaults():
    quick, cpu = Sizes.pick(quick=True, cuda=False), Sizes.pick(quick=False, cuda=False)
    assert quick.kmeans[0] < cpu.kmeans[0] < Sizes.pick(quick=False, cuda=True).kmeans[0] == 200_000
    assert quick.loop_window_s < cpu.loop_window_s


def test_the_table_has_one_line_per_row():
    rep = Report()
    rep.add("a", 1.5, "x")
    rep.add("longer row", 12345678.0)
    lines = rep.table().splitlines()
    assert len(lines) == 3 and "1.23e+07" in lines[2]


def test_a_skipped_row_has_no_value_and_says_why():
    rep = Report()
    rep.skip("open_clip row", "skipped: open_clip not installed")
    assert rep.rows[0].value is None and rep.table().splitlines()[1].split()[2] == "-"


@pytest.mark.slow
def test_the_lora_row_measures_lora_against_full_training_in_one_run():
    """Both sides measured in this run, each in its own subprocess: CLIP trained whole (here, with no
    CLIP row before it, the row's own) and with rank-8 LoRA; the adapter trains a few of the weights
    and, at micro sizes on the CPU, needs less memory (no gradient or AdamW moments for the towers)."""
    import torch

    from nclip.bench.budget import Budget
    from nclip.bench.context import Bench

    pytest.importorskip("peft")
    overrides = ["train.threads=1"]
    b = Bench("micro", overrides, resolve("micro", overrides), torch.device("cpu"), Sizes.pick(True, False),
              Budget(None), lambda msg: None)
    stages._stage_lora(b)
    rows = {r.what: r for r in b.rep.rows}
    assert set(rows) == set(stages.LORA_ROWS) and b.child_models["builds"] == 2
    full, lora = b.details["lora"]["full"], b.details["lora"]["lora"]
    assert full["trained_m"] == full["params_m"] and lora["trained_m"] < full["params_m"] / 20
    assert rows["lora / full step time"].value == pytest.approx(lora["step_s"] / full["step_s"])
    assert 0 < rows["lora / full peak memory"].value < 1 and "rank 8" in rows["lora / full step time"].detail
    resnet = resolve("micro", [*overrides, "model.vision.kind=resnet", "model.vision.depths=[1]",
                               "model.vision.hidden_sizes=[32]", "model.vision.embedding_size=16"])
    with pytest.raises(stages.OutOfBudget, match="skipped: LoRA has no default targets in a resnet image tower"):
        stages._stage_lora(Bench("micro", overrides, resnet, torch.device("cpu"), Sizes.pick(True, False),
                                 Budget(None), lambda msg: None))


@pytest.mark.slow
def test_the_trainer_row_builds_each_model_once_whatever_the_repeats(monkeypatch):
    builds = count_builds(monkeypatch)
    cfg = resolve("micro", ["train.threads=1"])
    out = loop_overhead.trainer_over_hand(cfg, repeats=3, window_s=0.01, warmup=1, count_flops=True)
    assert out["repeats"] == 3 and len(out["ratios"]) == 3 and out["flops"] > 0
    assert len(builds) == 2  # the hand loop's model and the trainer's, not one per repeat


@pytest.mark.slow
def test_the_train_path_row_reuses_the_hand_loop_and_builds_one_model(monkeypatch):
    from nclip.bench.train_path import train_path_over_hand

    cfg = resolve("micro", ["train.threads=1"])
    hand = loop_overhead.HandLoop(cfg, loop_overhead.one_batch(cfg))
    builds = count_builds(monkeypatch)
    r = train_path_over_hand(cfg, steps=3, repeats=2, hand=hand)
    assert len(builds) == 1  # the trainer's; the hand loop is the one passed in
    assert len(r["train_windows"]) == 2 and r["ratio"] > 0 and r["num_workers"] == cfg.data.num_workers


@pytest.mark.slow
def test_a_tiny_budget_skips_rows_and_says_why(monkeypatch):
    doc = runner.run_bench("micro", [], quick=True, compare=["open_clip"], budget_s=0.001)
    assert doc["budget_s"] == 0.001
    skipped = {r["row"]: r for r in doc["rows"] if r["value"] is None}
    assert "trainer / hand loop speed" in skipped and "nclip train path / hand loop samples/s" in skipped
    assert all(r["detail"].startswith("skipped: ") for r in skipped.values())
    assert doc["trainer_over_hand_loop"] is None  # never a made-up figure
    assert {s["stage"] for s in doc["skipped"]} >= {"loop", "train_path", "eval"}
    assert all(r["wall_s"] is not None for r in doc["rows"])


@pytest.mark.slow
def test_quick_bench_writes_positive_finite_ratios_builds_each_model_once_and_writes_no_model(
        tmp_path, capsys, monkeypatch, request):
    """One --quick run (the suite's only one: it takes a minute or two on 2 cores) checks every row's
    value: the speed and memory ratios, then the largest-batch and patch-dropout rows; and what the
    bench cost besides: the models it built, the bytes it wrote, each row's wall time."""
    from nclip.models import build_model

    weights = sum(p.numel() * p.element_size() for p in build_model(resolve("micro", [])).parameters())
    # open_clip's first import (its row runs in this process) makes torch's inductor cache folder in TMPDIR:
    # imported before the scratch TMPDIR, as transformers already is, so that the folder is not the bench's
    with contextlib.suppress(ImportError):
        import open_clip  # noqa: F401
    scratch = scratch_home(tmp_path, monkeypatch, request)
    build_calls = count_builds(monkeypatch)
    out = tmp_path / "bench.json"
    before = scratch["written"]()
    # no time budget: on a loaded machine a budget would skip rows, and this test is about their values
    assert main(["bench", "--quick", "--json", str(out), "--compare", "open_clip", "--budget-s", "0"]) == 0
    written = scratch["written"]() - before
    doc = json.loads(out.read_text())
    for key in ("trainer_over_hand_loop", "xclip_over_clip_time", "xclip_over_clip_memory", "mfu",
                "train_path_over_hand_loop", "lora_over_full_time", "lora_over_full_memory"):
        assert isinstance(doc[key], float) and math.isfinite(doc[key]) and doc[key] > 0, key
    assert doc["device"].startswith("cpu")
    measured = [r for r in doc["rows"] if r["value"] is not None]
    assert all(math.isfinite(r["value"]) and r["value"] > 0 for r in measured)
    assert all(isinstance(r["wall_s"], float) and r["wall_s"] >= 0 for r in doc["rows"])  # every row's own wall time
    assert {"trainer / hand loop speed", "nclip train path / hand loop samples/s"} <= {r["row"] for r in measured}
    assert set(doc["details"]["objectives"]) == {"clip", "xclip"}
    printed = capsys.readouterr()
    assert "trainer / hand loop speed" in printed.out and "nclip train path / hand loop" in printed.out
    if doc["open_clip"] is None:  # not installed here: the row says it is skipped
        assert "open_clip skipped" in printed.err
        row = next(r for r in doc["rows"] if r["row"].startswith("nclip clip / open_clip"))
        assert row["value"] is None and row["detail"] == "skipped: open_clip not installed"
    assert not doc["skipped"]  # the default budget holds at --quick
    _check_batch_memory_and_patch_dropout_rows(doc)
    _check_builds_and_writes(doc, build_calls, written, weights, scratch)


def _check_builds_and_writes(doc: dict, build_calls: list, written: int, weights: int, scratch: dict) -> None:
    """One build per model config and process: here the run's model (and with open_clip installed
    the CLIP model of its row), one in each objective subprocess and in the LoRA row's, two in the
    largest-batch subprocess (plain, checkpointed); fewer bytes written than one model's weights (every model
    save or checkpoint writes them all: the bench once made 13), and nothing left behind."""
    here = 1 + (doc["open_clip"] is not None)
    assert len(build_calls) == here
    stages = {s["stage"]: s for s in doc["stages"]}
    assert stages["objectives"]["builds"] == 2 and stages["batch_memory"]["builds"] == 2
    assert stages["lora"]["builds"] == 1  # the full side is the CLIP row's
    assert doc["models"]["builds"] == here + 5 == sum(s["builds"] for s in doc["stages"])
    assert doc["models"]["copies"] > doc["models"]["builds"]  # the rows got copies
    assert 0 < written < weights and 0 < doc["written_bytes"] <= written
    assert not any(any(scratch[d].iterdir()) for d in ("cwd", "home", "tmp"))


def _check_batch_memory_and_patch_dropout_rows(doc: dict) -> None:
    rows = {r["row"]: r for r in doc["rows"]}
    for name in [*stages.BATCH_ROWS.values(), *stages.PATCH_ROWS]:
        row = rows[name]
        assert isinstance(row["wall_s"], float) and row["wall_s"] >= 0, name
        assert row["value"] is not None and math.isfinite(row["value"]) and row["value"] > 0, (name, row["detail"])
    assert "not a run at that batch" in rows["largest batch (plain)"]["detail"]
    fits = doc["details"]["batch_memory"]["fits"]
    exact = fits["exact accumulation"]
    assert fits["none"]["points"] and exact["batch"] % exact["micro"] == 0 and exact["micro"] >= 16
    assert set(doc["details"]["patch_dropout"]["samples_per_s"]) == {"0.0", "0.5", "0.75"}  # JSON keys


def _fake_open_clip():
    """A stand-in for open_clip (not a dependency, not installed here): its create_model, ClipLoss."""
    import importlib.machinery
    import types

    import torch

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.img, self.txt = torch.nn.Linear(3, 8), torch.nn.Embedding(49408, 8)
            self.logit_scale = torch.nn.Parameter(torch.tensor(2.0))

        def forward(self, images, texts):
            norm = torch.nn.functional.normalize
            return norm(self.img(images.mean((2, 3))), dim=-1), norm(self.txt(texts).mean(1), dim=-1), \
                self.logit_scale.exp()

    def clip_loss():
        def loss(img, txt, scale):
            logits = scale * img @ txt.T
            target = torch.arange(len(img))
            return (torch.nn.functional.cross_entropy(logits, target)
                    + torch.nn.functional.cross_entropy(logits.T, target)) / 2
        return loss

    mod = types.ModuleType("open_clip")
    mod.__spec__ = importlib.machinery.ModuleSpec("open_clip", None)
    mod.model = types.SimpleNamespace(CLIP=lambda **towers: Tiny())
    mod.loss = types.SimpleNamespace(ClipLoss=clip_loss)
    return mod


@pytest.mark.slow
def test_the_open_clip_row_alternates_one_nclip_run_with_one_open_clip_model(monkeypatch):
    import sys

    from nclip.bench.objective_cost import config_with_objective
    from nclip.bench.open_clip_step import nclip_over_open_clip, open_clip_towers

    monkeypatch.setitem(sys.modules, "open_clip", _fake_open_clip())
    builds = count_builds(monkeypatch)
    cfg = config_with_objective("micro", ["train.threads=1"], "clip")
    r = nclip_over_open_clip(cfg, open_clip_towers(cfg), repeats=2, window_s=0.01, warmup=1)
    assert len(builds) == 1 and r["repeats"] == 2 and r["ratio"] > 0
    assert r["nclip_samples_per_s"] > 0 and r["open_clip_samples_per_s"] > 0 and r["batch_size"] == 16


def test_open_clip_is_compared_on_the_runs_own_towers():
    """At vit-b16-xclip the towers are open_clip's own ViT-B-16 config (its model_configs file), but for
    the run's vocabulary; a run whose towers open_clip cannot express is named, not compared."""
    from nclip.bench.open_clip_step import open_clip_towers
    from nclip.data.tokenization import CaptionTokenizer

    open_clip = pytest.importorskip("open_clip")
    b16 = json.loads((Path(open_clip.__file__).parent / "model_configs" / "ViT-B-16.json").read_text())
    cfg = resolve("vit-b16-xclip")
    towers = open_clip_towers(cfg)
    b16["text_cfg"]["vocab_size"] = CaptionTokenizer(77, cfg.model.text.tokenizer).vocab_size
    defaults = {"head_width": 64, "mlp_ratio": 4.0}  # open_clip's CLIPVisionCfg / CLIPTextCfg defaults
    assert towers["vision_cfg"] == {**b16["vision_cfg"], **defaults}
    assert towers["text_cfg"] == {**b16["text_cfg"], "mlp_ratio": 4.0}
    assert towers["embed_dim"] == b16["embed_dim"] and towers["quick_gelu"] is False
    assert "image tower 'convnet'" in open_clip_towers(resolve("tiny"))
    assert "text tower 'pretrained'" in open_clip_towers(resolve("micro", ["model.text.kind=pretrained"]))
