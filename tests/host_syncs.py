"""Find the host reads of a training step that logs nothing, with ``torch.profiler`` on the CPU.

On a GPU an op whose result the host needs (a scalar read, an output whose shape depends on the
data, a tensor made from host data) waits for every kernel queued before it: one such op per step
keeps the host from queuing the next step while the device runs this one (nclip.train.gate). On
the CPU nothing waits, but the same ops run: the profiler lists them at the C++ level, where a
patch of Python's ``Tensor.item`` cannot see them (``torch.bincount`` on CUDA reads its min and
max inside the op).

``SYNC_OPS`` are the aten ops that read the device on CUDA. The CPU fused optimizer kernels read
their ``found_inf`` and step count with ``item()`` internally; their CUDA versions read nothing, so
reads under them are not counted. Three reads do not reach the dispatcher on the CPU (``tolist``,
``numpy``, ``cpu`` of a CPU tensor): they are caught by patching ``torch.Tensor``.

The first step of a run is not checked: it makes the optimizer's state and any lazily sized
buffer, once per run.
"""

from __future__ import annotations

import collections
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import nclip.train.loop as loop_mod

SYNC_OPS = frozenset({
    "aten::_local_scalar_dense",  # item(), float(), int(), bool() of a tensor
    "aten::is_nonzero",  # bool() of a one-element tensor, `if tensor:`
    "aten::nonzero", "aten::nonzero_static",  # output shape from the data (boolean indexing, torch.where(c))
    "aten::masked_select",
    "aten::bincount",  # on CUDA: reads min and max to size its output
    "aten::unique", "aten::_unique", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
    "aten::equal", "aten::allclose",
    "aten::lift_fresh",  # torch.tensor(host data): a blocking host-to-device copy on CUDA
})
FUSED_OPTIMIZERS = ("aten::_fused_adamw_", "aten::_fused_adam_", "aten::_fused_sgd_")
HOST_METHODS = ("tolist", "numpy", "cpu")  # invisible to the profiler on a CPU tensor

# the step's options that add work to it (the CPU test and benchmarks/gpu_sync_check.py check both)
CONVNET = ["model.vision.kind=convnet", "model.vision.depths=[1,1]", "model.vision.hidden_sizes=[16,32]",
           "model.vision.embedding_size=8", "model.vision.heads=2"]

OPTIONS = {
    "ema-locked-vision": ["train.ema=0.99", "model.vision.lock=true"],
    "exact-accumulation": ["train.accumulation=2"],
    "independent-accumulation": ["train.accumulation=2", "train.accumulation_mode=independent"],
    "patch-dropout": ["model.vision.patch_dropout=0.5"],
    "nclip-warmup": ["objective.nclip_warmup_start=1", "objective.nclip_warmup_steps=3"],
    "text-unlocked-layers": ["model.text.unlocked_layers=1"],
    "pretrained-text": ["model.text.kind=pretrained"],
    "adamw8bit": ["train.optimizer=adamw8bit"],
    "fp16": ["train.precision=fp16"],
    "sgd-convnet": ["objective.name=clip", "train.optimizer=sgd", *CONVNET],
    "cmsf-semi": ["objective.name=cmsf", "objective.constraint=semi", "objective.bank_size=64"],  # 2 banks of 64
}


def _where(event) -> str:
    """The innermost nclip (or transformers / kornia) frame of the Python stack that made ``event``."""
    node = event
    while node is not None:  # Python frames are the profiled op's ancestors (with_stack)
        for frame in (node.name, *(node.stack or ())):
            if "nclip/" in frame or "transformers/" in frame or "kornia/" in frame:
                return frame.split("site-packages/")[-1].split("src/")[-1]
        node = node.cpu_parent
    return "?"


def _under_fused_optimizer(event) -> bool:
    node = event.cpu_parent
    while node is not None:
        if node.name in FUSED_OPTIMIZERS:
            return True
        node = node.cpu_parent
    return False


def quiet_steps(step_index: int, cfg) -> bool:
    """Steps after the first that neither log nor checkpoint (0-based index)."""
    t, done = cfg.train, step_index + 1
    return step_index > 0 and done % t.log_every != 0 and done % t.checkpoint_every != 0 and done != t.steps


class SyncRecorder:
    """Patches ``nclip.train.loop._step`` to profile the quiet steps; ``found`` counts
    ``(op, where)``. Use as ``with SyncRecorder(monkeypatch) as rec: train(...)``."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch
        self.found: collections.Counter = collections.Counter()
        self.steps_checked = 0
        self._armed = False

    def __enter__(self) -> SyncRecorder:
        real_step = loop_mod._step
        for name in HOST_METHODS:
            self._patch_method(name)

        def step(info, learner, index, batch):
            if not quiet_steps(index, info.cfg):
                return real_step(info, learner, index, batch)
            self._armed = True
            try:
                with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
                    result = real_step(info, learner, index, batch)
            finally:
                self._armed = False
            self.steps_checked += 1
            for event in prof.events():
                if event.name in SYNC_OPS and not _under_fused_optimizer(event):
                    self.found[(event.name, _where(event))] += 1
            return result

        self.monkeypatch.setattr(loop_mod, "_step", step)
        return self

    def _patch_method(self, name: str) -> None:
        original = getattr(torch.Tensor, name)
        recorder = self

        def recording(self, *args, **kwargs):
            if recorder._armed:
                import traceback

                frames = [f for f in traceback.extract_stack()[:-1] if "nclip/" in f.filename]
                where = f"{frames[-1].filename.split('src/')[-1]}:{frames[-1].lineno}" if frames else "?"
                recorder.found[(f"Tensor.{name}", where)] += 1
            return original(self, *args, **kwargs)

        self.monkeypatch.setattr(torch.Tensor, name, recording)

    def __exit__(self, *exc) -> None:
        return None

    def report(self) -> str:
        return "; ".join(f"{op} ×{n} at {where}" for (op, where), n in sorted(self.found.items()))


def train_quietly(cfg, run_dir: Path, monkeypatch) -> SyncRecorder:
    """Train ``cfg`` (no evaluation) with its quiet steps profiled."""
    with SyncRecorder(monkeypatch) as rec:
        loop_mod.train(cfg, run_dir, progress=False, evaluate=False)
    return rec
