"""Evaluation while training (``train.eval_every``, nclip.train.periodic_eval): its config checks,
its figures on the row of their step, a training trajectory bitwise equal to the one without it,
one evaluation per step across a resume, and the other ranks waiting for rank 0."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from nclip.config import resolve
from nclip.errors import NclipError
from nclip.train.checkpoint import list_checkpoints, read_checkpoint
from nclip.train.loop import train
from nclip.train.periodic_eval import describe, untouched

from conftest import MICRO_OVERRIDES, metrics_then_resumed
from distributed_utils import run_ranks

EVAL = ["train.eval_samples=16", "train.threads=1", "data.train_length=64"]


def _cfg(*extra, preset="micro"):
    return resolve(preset, [*MICRO_OVERRIDES, *EVAL, *extra])


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _training(row: dict) -> dict:
    """A row without the evaluation and the wall-clock fields."""
    return {k: v for k, v in row.items()
            if not k.startswith(("eval/", "ema/eval/")) and k not in ("eval_s", "samples_per_s", "data_wait_s")}


# ---------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("override, match", [
    ("train.eval_datasets=[nosuch]", r"train\.eval_datasets: unknown dataset 'nosuch'"),
    ("train.eval_datasets=[digits, digits]", "listed twice"),
    ("train.eval_datasets=[folder:]", "expected a list of dataset specs"),
    ("train.eval_every=-1", "train.eval_every"),
    ("train.eval_samples=2", "train.eval_samples"),
])
def test_bad_settings_are_one_line_config_errors(override, match):
    with pytest.raises(NclipError, match=match) as e:
        resolve("micro", [override])
    assert "\n" not in str(e.value)


def test_specs_are_those_of_nclip_eval():
    assert resolve("micro", ["train.eval_datasets=digits"]).train.eval_datasets == ["digits"]
    cfg = resolve("micro", ["train.eval_datasets=[digits, 'folder:/data/pets', 'captions:/data/c.csv']"])
    assert cfg.train.eval_datasets == ["digits", "folder:/data/pets", "captions:/data/c.csv"]
    assert resolve("micro").train.eval_every > 0  # on by default, where there is held-out data
    csv = resolve("micro", ["data.source=csv", "data.csv=/x.csv"])
    assert describe(csv, None).startswith("off: data.source csv has no built-in held-out data")


def test_missing_eval_data_fails_in_one_line_before_anything_is_written(tmp_path):
    with pytest.raises(NclipError, match="not found|does not exist|no such") as e:
        train(_cfg(f"train.eval_datasets=['folder:{tmp_path / 'nope'}']"), tmp_path / "run", progress=False,
              evaluate=False)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "run" / "config.yaml").exists()


# ---------------------------------------------------------------------------------------------
# no trace on the training
# ---------------------------------------------------------------------------------------------


def test_untouched_puts_back_modes_and_every_rng():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2), torch.nn.Dropout(0.5))
    model.train()
    model[1].eval()  # e.g. a locked tower's normalisation stays in eval mode
    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    with untouched(model):
        model.eval()
        torch.rand(3), np.random.rand(3), random.random()
    assert [m.training for m in model.modules()] == [True, True, False, True]
    assert torch.equal(torch.get_rng_state(), before[0])
    assert (np.random.get_state()[1] == before[1]).all() and random.getstate() == before[2]


@pytest.mark.slow
@pytest.mark.parametrize("preset, extra, key", [
    # patch dropout draws from torch's RNG every step; the nCLIP head's BatchNorm keeps statistics
    ("micro", ["model.vision.patch_dropout=0.5"], "eval/zeroshot/synthetic-shape/top1"),
    ("cmsf-tiny", [], "eval/knn/digits-digit/top1"),  # image-only: k-NN; a momentum target, BN MLPs
    # train.ema: the averaged weights are evaluated too (swapped in, and the trained ones put back)
    ("micro", ["train.ema=0.5"], "ema/eval/zeroshot/synthetic-shape/top1"),
])
def test_training_is_bitwise_the_same_with_evaluation(tmp_path, preset, extra, key):
    runs = {}
    for every in (0, 2):
        runs[every] = tmp_path / f"every{every}"
        train(_cfg(*extra, f"train.eval_every={every}", preset=preset), runs[every], progress=False, evaluate=False)
    off, on = _rows(runs[0]), _rows(runs[2])
    assert [r["step"] for r in on] == [r["step"] for r in off] == [2, 4, 6]
    assert [_training(r) for r in on] == [_training(r) for r in off]
    assert all(key in r and r["eval_s"] > 0 for r in on) and not any(key in r for r in off)
    assert all(r["samples_per_s"] > 0 for r in on)
    for a, b in zip(list_checkpoints(runs[0]), list_checkpoints(runs[2])):
        (wa, sa), (wb, sb) = read_checkpoint(a), read_checkpoint(b)
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)  # BN statistics included
        assert all(torch.equal(sa["objective"][k], sb["objective"][k]) for k in sa["objective"])
        assert torch.equal(sa["rng"][0]["torch"], sb["rng"][0]["torch"])
        if "ema" in sa:  # the average itself is untouched by being evaluated
            ea, eb = sa["ema"], sb["ema"]
            assert ea.keys() == eb.keys() and all(torch.equal(ea[k], eb[k]) for k in ea)
    if key.startswith("ema/"):  # the raw weights are scored beside the average
        assert all(key.removeprefix("ema/") in r for r in on)


@pytest.mark.slow
def test_an_evaluation_happens_once_across_a_resume(tmp_path):
    # evaluations at 3 and 6, rows at 2, 3, 4, 6, checkpoints at 3 and 6; the run loses its step-6
    # checkpoint and resumes from 3: step 3's evaluation (written before its checkpoint) is not
    # repeated, step 6's is redone and its row replaces the lost one
    cfg = _cfg("train.eval_every=3", "train.eval_datasets=[synthetic, digits]")
    first, resumed = metrics_then_resumed(cfg, tmp_path / "run")
    assert [r["step"] for r in resumed] == [2, 3, 4, 6]
    evaluated = [r["step"] for r in resumed if "eval/zeroshot/digits-digit/top1" in r]
    assert evaluated == [3, 6]
    assert all("eval/retrieval/synthetic/mean_recall" in r for r in resumed if r["step"] in evaluated)
    assert resumed == first  # the figures too: the same weights give the same evaluation


# ---------------------------------------------------------------------------------------------
# two ranks: rank 0 evaluates, the other waits
# ---------------------------------------------------------------------------------------------


def _two_ranks(rank: int, world: int, root: str) -> None:
    for strategy in ("ddp", "fsdp"):  # one spawn for both: the processes' start-up is most of the cost
        train(_cfg("train.eval_every=2", "train.steps=4", f"train.strategy={strategy}"), Path(root) / strategy,
              progress=False, evaluate=False)


@pytest.mark.slow
def test_two_ranks_write_rank_zeros_evaluation(tmp_path):
    run_ranks(_two_ranks, world_size=2, args=(str(tmp_path),), timeout=300)
    train(_cfg("train.eval_every=2", "train.steps=4"), tmp_path / "single", progress=False, evaluate=False)
    single = _rows(tmp_path / "single")
    for strategy in ("ddp", "fsdp"):  # FSDP: the whole weights gathered on every rank, evaluated on rank 0
        rows = _rows(tmp_path / strategy)
        assert [r["step"] for r in rows] == [2, 4]
        for a, b in zip(rows, single):  # the same (global-batch) weights: the same figures, up to rounding
            keys = [k for k in b if k.startswith("eval/")]
            assert keys and set(keys) == {k for k in a if k.startswith("eval/")}
            for k in keys:
                assert a[k] == pytest.approx(b[k], abs=0.07), (strategy, a["step"], k)
