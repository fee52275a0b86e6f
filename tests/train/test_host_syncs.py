"""No host sync on a step that logs nothing, proven with the profiler (tests/host_syncs.py).

Every registered objective, and the step's options that add work to it: EMA, exact and independent
accumulation, patch dropout, the λ_nCLIP warm-up, locked towers, the pretrained text tower,
``adamw8bit``, the SGD update, CMSF's ``semi`` constraint, and 2 gloo ranks with BatchNorm in the
heads and in the image tower (global-batch statistics). The count must be zero: a read that cannot
be avoided is named in ``UNAVOIDABLE`` with its reason, and docs/performance.md says what it costs.
"""

from __future__ import annotations

import pytest
import torch

from nclip.config import resolve
from nclip.objectives import REGISTRY

from conftest import micro_objective, micro_sizes
from distributed_utils import run_ranks
from host_syncs import CONVNET, OPTIONS, SyncRecorder, train_quietly

pytestmark = pytest.mark.usefixtures("one_thread")

# 5 steps, logging at 4 and 5: steps 2 and 3 are checked (the first one makes the optimizer's state)
QUIET = ["train.steps=5", "train.log_every=4", "train.checkpoint_every=100", "train.batch_size=8",
         "data.train_length=64", "train.eval_every=0"]

# reads that cannot be avoided: (op, a part of where it is made) -> why
UNAVOIDABLE: dict[tuple[str, str], str] = {}


def _unexplained(rec: SyncRecorder) -> dict:
    return {key: n for key, n in rec.found.items()
            if not any(key[0] == op and where in key[1] for op, where in UNAVOIDABLE)}


def _check(overrides: list[str], tmp_path, monkeypatch) -> None:
    cfg = resolve("micro", micro_sizes() + QUIET + overrides)
    rec = train_quietly(cfg, tmp_path, monkeypatch)
    assert rec.steps_checked == 2
    assert not _unexplained(rec), f"host syncs in steps that log nothing: {rec.report()}"


@pytest.mark.parametrize("name", list(REGISTRY))
def test_no_host_sync_in_a_quiet_step_of_every_objective(name, tmp_path, monkeypatch):
    _check(micro_objective(name), tmp_path, monkeypatch)


@pytest.mark.parametrize("option", list(OPTIONS))
def test_no_host_sync_in_a_quiet_step_with(option, tmp_path, monkeypatch):
    if option == "adamw8bit":
        pytest.importorskip("torchao")
    _check(OPTIONS[option], tmp_path, monkeypatch)


def _two_ranks(rank: int, world: int, tmp: str) -> dict:
    import pytest as _pytest

    monkeypatch = _pytest.MonkeyPatch()
    try:
        cfg = resolve("micro", micro_sizes() + QUIET + CONVNET + ["model.sync_batchnorm=true"])
        rec = train_quietly(cfg, f"{tmp}/run", monkeypatch)
        return {"found": dict(rec.found), "checked": rec.steps_checked, "report": rec.report()}
    finally:
        monkeypatch.undo()


@pytest.mark.slow
def test_no_host_sync_in_a_quiet_step_on_two_ranks_with_global_batchnorm(tmp_path):
    """xCLIP's heads and the convnet tower hold BatchNorm; with two ranks their statistics are the
    global batch's (nclip.models.sync_batchnorm), computed through collectives in every layer."""
    for rank, got in enumerate(run_ranks(_two_ranks, world_size=2, args=(str(tmp_path),), timeout=300)):
        assert got["checked"] == 2, rank
        assert not got["found"], f"rank {rank}: {got['report']}"


def test_the_recorder_sees_a_read_inside_a_cpp_op(tmp_path, monkeypatch):
    """The check is not blind: a bincount (a read on CUDA, none in Python), a scalar read and a tensor
    made from host data inside the objective's forward are each found, at the line that made them."""
    from nclip.objectives.clip import ClipObjective

    original = ClipObjective.forward

    def forward(self, out, batch=None):
        terms = original(self, out, batch)
        torch.bincount(torch.zeros(3, dtype=torch.long, device=out.image["clip"].device))
        terms["loss"].detach().sum().item()
        terms["loss"] = terms["loss"] + torch.tensor(0.0)
        return terms

    monkeypatch.setattr(ClipObjective, "forward", forward)
    cfg = resolve("micro", micro_sizes() + QUIET + ["objective.name=clip"])
    rec = train_quietly(cfg, tmp_path, monkeypatch)
    ops = {op: where for (op, where), n in rec.found.items()}
    assert set(ops) >= {"aten::bincount", "aten::_local_scalar_dense", "aten::lift_fresh"}, rec.report()
    assert sum(n for (op, _), n in rec.found.items() if op == "aten::bincount") == 2  # steps 2 and 3


def test_the_recorder_sees_a_host_method(tmp_path, monkeypatch):
    """tolist / numpy / cpu of a CPU tensor reach no aten op: they are patched instead."""
    from nclip.objectives.clip import ClipObjective

    original = ClipObjective.forward

    def forward(self, out, batch=None):
        terms = original(self, out, batch)
        terms["loss"].detach().tolist()
        return terms

    monkeypatch.setattr(ClipObjective, "forward", forward)
    cfg = resolve("micro", micro_sizes() + QUIET + ["objective.name=clip"])
    rec = train_quietly(cfg, tmp_path, monkeypatch)
    assert sum(n for (op, _), n in rec.found.items() if op == "Tensor.tolist") == 2, rec.report()
