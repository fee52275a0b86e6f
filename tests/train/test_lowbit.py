"""``train.optimizer: adamw8bit`` (nclip.train.lowbit): 8-bit moments where tensors are large,
AdamW's trajectory within tolerance, exact resume, one-line errors, and torchao's update gated on
the device (a skipped step leaves every bit, fp16's loss scale divided out)."""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from nclip.cli import main
from nclip.config import resolve
from nclip.errors import NclipError
from nclip.train.checkpoint import list_checkpoints, read_checkpoint
from nclip.train.gate import StepGate
from nclip.train.loop import train
from nclip.train.loss_scale import INIT_SCALE

from conftest import micro_sizes

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed")

OVERRIDES = micro_sizes() + [
    "train.steps=12", "train.batch_size=16", "train.warmup_steps=2", "train.log_every=1",
    "train.checkpoint_every=4", "train.keep_checkpoints=3", "train.threads=1", "data.train_length=256",
]


def _final_loss(run) -> float:
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["loss"]


@needs_torchao
@pytest.mark.slow  # the first 8-bit step compiles its update kernels (tens of seconds on 2 cores)
def test_adamw8bit_quantises_large_moments_follows_adamw_and_resumes_exactly(tmp_path):
    runs = {}
    for name in ("adamw", "adamw8bit"):
        runs[name] = tmp_path / name
        summary = train(resolve("micro", OVERRIDES + [f"train.optimizer={name}"]), runs[name],
                        progress=False, evaluate=False)
        assert summary is not None
    # the same trajectory within tolerance: the final loss of 12 micro steps differs by < 1 %
    a, b = _final_loss(runs["adamw"]), _final_loss(runs["adamw8bit"])
    assert abs(a - b) < 0.01 * abs(a), (a, b)

    # the checkpointed state: uint8 codes for every tensor of >= 4096 values in whole blocks of 256
    # (torchao's rule), far fewer bytes
    _, state8 = read_checkpoint(list_checkpoints(runs["adamw8bit"])[-1])
    moments = [s["exp_avg"] for s in state8["optimizer"]["state"].values()]
    quantised = [m for m in moments if type(m) is not torch.Tensor]
    assert quantised and all(m.codes.dtype == torch.uint8 for m in quantised)
    assert all(m.numel() < 4096 or m.numel() % 256 for m in moments if type(m) is torch.Tensor)

    # codes (1 byte per value) and block scales (4 bytes per 256 values) for both moments
    for name in ("exp_avg", "exp_avg_sq"):
        for m in (s[name] for s in state8["optimizer"]["state"].values()):
            if type(m) is not torch.Tensor:
                assert m.codes.numel() + 4 * m.scale.numel() < 0.26 * 4 * m.numel()

    # exact resume: continue from the step-4 checkpoint, end with the uninterrupted run's weights
    resumed = tmp_path / "resumed"
    shutil.copytree(runs["adamw8bit"], resumed)
    for ckpt in list_checkpoints(resumed)[1:]:
        shutil.rmtree(ckpt)
    shutil.rmtree(resumed / "model")
    args = ["train", "--preset", "micro", "--out", str(resumed), "--no-progress", "--no-eval",
            "--resume", "auto"] + [x for o in OVERRIDES + ["train.optimizer=adamw8bit"] for x in ("--set", o)]
    assert main(args) == 0
    want = load_file(runs["adamw8bit"] / "model" / "model.safetensors")
    got = load_file(resumed / "model" / "model.safetensors")
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_adamw8bit_without_torchao_is_a_one_line_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(NclipError, match=r"pip install nclip\[lowmem\]"):
        resolve("micro", ["train.optimizer=adamw8bit"])


@needs_torchao
def test_adamw8bit_with_fsdp_is_refused():
    with pytest.raises(NclipError, match="adamw8bit is not supported with strategy fsdp"):
        resolve("micro", ["train.optimizer=adamw8bit", "train.strategy=fsdp"])


def _bits(optimizer, model) -> list[torch.Tensor]:
    """Every tensor of the parameters and of their state: 8-bit moments as codes and block scales."""
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        for value in optimizer.state[p].values():
            parts = (value.codes, value.scale) if hasattr(value, "codes") else (value,)
            out += [t.clone() for t in parts]
    return out


def _set_grads(model, seed: int, scale: float = 1.0) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator) * scale


@needs_torchao
@pytest.mark.slow  # compiles the update of two shapes, gated and torchao's own (tens of seconds on 2 cores)
def test_adamw8bit_is_torchaos_update_gated_on_the_device():
    """nclip's step is torchao's, bit for bit; a skipped step (found_inf, no host read) leaves the
    weights, the 8-bit codes and scales, the float32 moments and the step count as they were; under
    fp16 the kernel divides the scaled gradients by the loss scale exactly."""
    from nclip.train.lowbit import _import_adamw8bit, adamw8bit

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)  # weight: 4096 values, 8-bit moments; bias: float32 moments
    reference = copy.deepcopy(model)
    cfg = resolve("micro", []).train
    groups = [{"params": list(model.parameters()), "weight_decay": 0.1}]
    ours = adamw8bit(groups, cfg)
    theirs = _import_adamw8bit()(reference.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=0.1)
    gate = StepGate(ours, torch.device("cpu"), {}, torch.float16)
    assert gate.on_device

    def taken(seed: int) -> None:
        _set_grads(model, seed, float(gate.loss_scale.scale))  # as the backward of the scaled loss leaves them
        _set_grads(reference, seed)
        gate.step(torch.zeros(()))
        theirs.step()
        assert all(torch.equal(a, b) for a, b in zip(_bits(ours, model), _bits(theirs, reference))), seed

    taken(0)
    assert type(ours.state[model.weight]["exp_avg"]) is not torch.Tensor  # quantised
    before = _bits(ours, model)
    _set_grads(model, 1, INIT_SCALE)
    gate.step(torch.ones(()))  # skipped
    after = _bits(ours, model)
    assert len(after) == len(before) == 10 and all(torch.equal(a, b) for a, b in zip(before, after))
    assert gate.loss_scale.scale == INIT_SCALE / 2  # backed off: the next gradients come scaled by 2^15
    taken(2)  # the skipped step took no count: the bias corrections are those of step 2
    assert ours.state[model.weight]["step"] == 2
