"""Training with model.lora: a killed run resumes bitwise (LoRA's dropout included, under exact
accumulation too), exact accumulation is the whole batch's step, and 2 ranks (DDP, FSDP2, DDP with
exact accumulation, a modified ResNet's frozen BatchNorm under DDP) log what one process logs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nclip.config import resolve
from nclip.train.loop import train

from conftest import metrics_then_resumed, micro_sizes

pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SHORT = ["train.steps=6", "train.batch_size=16", "train.log_every=1", "train.checkpoint_every=3",
         "data.train_length=64", "train.eval_every=0", "train.warmup_steps=1", "train.threads=1",
         "model.lora.rank=4"]
CONV = ["model.vision.kind=clip_resnet", "model.vision.depths=[1,1]", "model.vision.hidden_sizes=[16,32]",
        "model.vision.embedding_size=16", "model.vision.heads=2"]


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("extra", [(), ("train.accumulation=2",)], ids=["k1", "exact-k2"])
def test_a_lora_run_resumes_bitwise(tmp_path, extra):
    cfg = resolve("micro", micro_sizes() + SHORT + ["model.lora.dropout=0.2", *extra])
    first, resumed = metrics_then_resumed(cfg, tmp_path / "run")
    assert first == resumed and len(first) == 6
    assert (tmp_path / "run" / "model" / "adapter_model.safetensors").is_file()


def test_exact_accumulation_is_the_whole_batchs_step(tmp_path):
    runs = {}
    for k in (1, 2):
        run = tmp_path / f"k{k}"
        train(resolve("micro", micro_sizes() + SHORT + [f"train.accumulation={k}"]), run, progress=False,
              evaluate=False)
        runs[k] = _rows(run)
    for a, b in zip(runs[1], runs[2]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6), a["step"]
    assert runs[1][0]["loss"] != runs[1][-1]["loss"]


RUNS = {"ddp": [], "fsdp": ["train.strategy=fsdp"], "ddp-exact-k2": ["train.accumulation=2"], "ddp-clip_resnet": CONV}
RANK_STEPS = ["train.steps=4", "train.batch_size=8", "train.checkpoint_every=2"]


def _run_cfg(name: str):
    return resolve("micro", micro_sizes() + SHORT + RANK_STEPS + RUNS[name])


def _ranks(rank: int, world: int, root: str):
    for name in RUNS:
        train(_run_cfg(name), Path(root) / name, progress=False, evaluate=False)
    return {}


@pytest.mark.slow
def test_two_ranks_log_what_one_process_logs(tmp_path):
    from distributed_utils import run_ranks

    run_ranks(_ranks, 2, args=(str(tmp_path / "ranks"),), init="torchrun")
    for name in RUNS:
        if name in ("ddp", "ddp-clip_resnet"):  # the others' one-process run is the same as ddp's
            train(_run_cfg(name), tmp_path / "one" / name, progress=False, evaluate=False)
        single = _rows(tmp_path / "one" / ("ddp-clip_resnet" if name == "ddp-clip_resnet" else "ddp"))
        rows = _rows(tmp_path / "ranks" / name)
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        for a, b in zip(rows, single):
            for key in ("loss", "clip/loss", "nclip/loss"):
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (name, a["step"], key)
        assert (tmp_path / "ranks" / name / "model" / "adapter_model.safetensors").is_file()
