"""No host round trip on a step that logs nothing (nclip.train.gate).

On a GPU, reading a tensor on the host (``item``, ``tolist``, ``float()``, ``bool()``, ``int()``,
``.cpu()``, ``.numpy()``) waits for every kernel queued before it: one such read per step keeps the
host from queuing the next step while the device runs this one. On the CPU nothing waits, so the
test counts the calls instead: around every step that does not log (the model's forward, the
objective, backward, the skip decision and the optimizer update included) there must be none.
"""

from __future__ import annotations

import pytest
import torch

import nclip.train.loop as loop_mod
from nclip.config import resolve

from conftest import micro_sizes

pytestmark = pytest.mark.usefixtures("one_thread")

READS = ("item", "tolist", "__float__", "__bool__", "__int__", "cpu", "numpy")
STEPS, LOG_EVERY = 6, 3


def _count_reads_in_quiet_steps(monkeypatch) -> list[str]:
    """Patch the host reads of torch.Tensor to record their names while a non-logging step runs."""
    seen: list[str] = []
    armed = [False]
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _name=name, _original=original, **kwargs):
            if armed[0]:
                seen.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    real_step = loop_mod._step

    def step(run, index, batch):
        quiet = (index + 1) % LOG_EVERY != 0 and index + 1 != run.cfg.train.steps
        armed[0] = quiet
        try:
            return real_step(run, index, batch)
        finally:
            armed[0] = False

    monkeypatch.setattr(loop_mod, "_step", step)
    return seen


CASES = {
    "xclip": [],
    "xclip-exact-accumulation": ["train.accumulation=2"],
    "xclip-independent-accumulation": ["train.accumulation=2", "train.accumulation_mode=independent"],
    "xclip-ema-locked-vision": ["train.ema=0.99", "model.vision.lock=true"],  # nclip.train.ema, models.locking
    "nclip": ["objective.name=nclip"],
    "siglip": ["objective.name=siglip"],
    "supcon": ["objective.name=supcon"],
    "clip-sgd-convnet": ["objective.name=clip", "train.optimizer=sgd", "model.vision.kind=convnet",
                         "model.vision.depths=[1,1]", "model.vision.hidden_sizes=[16,32]",
                         "model.vision.embedding_size=8", "model.vision.heads=2"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_no_host_read_on_a_step_that_does_not_log(case, tmp_path, monkeypatch):
    seen = _count_reads_in_quiet_steps(monkeypatch)
    cfg = resolve("micro", micro_sizes() + [f"train.steps={STEPS}", f"train.log_every={LOG_EVERY}",
                                             "train.batch_size=8", "train.checkpoint_every=100",
                                             "data.train_length=64"] + CASES[case])
    loop_mod.train(cfg, tmp_path, progress=False, evaluate=False)
    assert seen == [], f"{case}: host reads in steps that log nothing: {sorted(set(seen))}"


def test_cmsf_reads_only_its_bank_fill(tmp_path, monkeypatch):
    """Known, documented (docs/runs.md): CMSF's memory bank view has as many rows as the bank holds,
    a shape that depends on data on the device, so its forward reads the fill count (``int``) each
    step. Nothing else in a CMSF step reads the device."""
    seen = _count_reads_in_quiet_steps(monkeypatch)
    cfg = resolve("micro", micro_sizes() + [f"train.steps={STEPS}", f"train.log_every={LOG_EVERY}",
                                             "train.batch_size=8", "data.train_length=64", "objective.name=cmsf"])
    loop_mod.train(cfg, tmp_path, progress=False, evaluate=False)
    assert set(seen) == {"__int__"} and len(seen) % 4 == 0  # the same reads in each quiet step (1, 2, 4, 5)


def test_the_counter_sees_a_host_read(tmp_path, monkeypatch):
    """The patch works: a read inside the objective's forward is counted."""
    from nclip.objectives.nclip import XclipObjective

    seen = _count_reads_in_quiet_steps(monkeypatch)
    original = XclipObjective.forward

    def forward(self, out):
        terms = original(self, out)
        float(terms["loss"])
        return terms

    monkeypatch.setattr(XclipObjective, "forward", forward)
    cfg = resolve("micro", micro_sizes() + [f"train.steps={STEPS}", f"train.log_every={LOG_EVERY}",
                                             "train.batch_size=8", "data.train_length=64"])
    loop_mod.train(cfg, tmp_path, progress=False, evaluate=False)
    assert seen.count("__float__") == 4  # steps 1, 2, 4, 5 log nothing
