"""What a run does with several CUDA devices, checked on the CPU with torch.cuda's functions
replaced: each rank makes its own GPU the current device however the process group was made, and
a checkpoint keeps (and a resume restores) every device's RNG state."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nclip.config import resolve
from nclip.train import checkpoint, launch


@pytest.fixture
def four_gpus(monkeypatch):
    """torch.cuda with four devices that records set_device and keeps one RNG state per device."""
    calls = {"set_device": [], "states": {i: torch.tensor([i], dtype=torch.uint8) for i in range(4)}}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls["set_device"].append(torch.device(d)))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [calls["states"][i].clone() for i in range(4)])

    def set_rng_state(state, device="cuda"):
        index = 0 if device == "cuda" else device  # the current device: 0 here
        calls["states"][index] = state.clone()

    monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
    return calls


def test_a_caller_made_process_group_still_gets_its_local_gpu(four_gpus, monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 3)
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "2")  # global rank 3, this node's GPU 2
    ctx = launch.setup(resolve("micro", ["train.device=cuda"]))
    assert ctx.device == torch.device("cuda", 2) and not ctx.owns_group
    assert four_gpus["set_device"] == [torch.device("cuda", 2)]


def test_torchrun_and_single_process_runs_set_their_device(four_gpus, monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: None)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert launch.setup(resolve("micro", ["train.device=cuda"])).device == torch.device("cuda", 1)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert launch.setup(resolve("micro", ["train.device=cuda"])).device == torch.device("cuda", 0)
    assert four_gpus["set_device"] == [torch.device("cuda", 1), torch.device("cuda", 0)]


def test_a_cpu_run_sets_no_device(four_gpus, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert launch.setup(resolve("micro", ["train.device=cpu"])).device == torch.device("cpu")
    assert four_gpus["set_device"] == []


def test_the_checkpoint_keeps_every_devices_rng_state(four_gpus):
    state = checkpoint.rng_state()
    assert [int(s) for s in state["cuda"]] == [0, 1, 2, 3]
    for i in range(4):
        four_gpus["states"][i] = torch.tensor([9], dtype=torch.uint8)  # the run draws on
    checkpoint.set_rng_state(state)
    assert [int(four_gpus["states"][i]) for i in range(4)] == [0, 1, 2, 3]
    # a checkpoint written before (the current device's state alone) still restores that one
    old = dict(state, cuda=torch.tensor([7], dtype=torch.uint8))
    checkpoint.set_rng_state(old)
    assert [int(four_gpus["states"][i]) for i in range(4)] == [7, 1, 2, 3]


def test_a_resume_on_fewer_devices_restores_those_it_has(four_gpus, monkeypatch):
    state = dict(checkpoint.rng_state(), cuda=[torch.tensor([5 + i], dtype=torch.uint8) for i in range(6)])
    checkpoint.set_rng_state(state)
    assert [int(four_gpus["states"][i]) for i in range(4)] == [5, 6, 7, 8]


def test_on_the_cpu_the_rng_state_is_unchanged(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    state = checkpoint.rng_state()
    assert "cuda" not in state and set(state) == {"torch", "numpy", "python"}
    x = torch.rand(3)
    checkpoint.set_rng_state(state)
    assert torch.equal(torch.rand(3), x)
