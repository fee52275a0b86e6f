"""Exact accumulation (nclip.train.accumulate): for every registered objective, one step in k
micro-batches equals one step on the whole global batch — the loss, every logged term, every
parameter gradient and the heads' BatchNorm statistics, in float64 — on one process (k = 4) and on
2 gloo ranks (k = 2 each) against one process with the whole batch.

Registering an objective makes these tests cover it (a new one that needs inputs beyond what
:func:`train_loader` gives, as ProtoCLIP's episode, says so in ``_prepare``)."""

from __future__ import annotations

import copy

import pytest
import torch

from nclip.config import resolve
from nclip.data.labels import label_space_for
from nclip.data.loader import train_loader
from nclip.models import build_model
from nclip.objectives import REGISTRY, build_objective
from nclip.train.accumulate import cached_step, online_towers
from nclip.train.launch import DistContext, wrap
from nclip.train.snapshot import BufferSnapshot
from nclip.train.step import TrainStep, wrap_passes

from conftest import micro_objective, micro_sizes
from distributed_utils import run_ranks

B = 16  # the global batch
CPU = torch.device("cpu")


# GroupViT's tower at the micro sizes: one grouping stage (4 groups), or two as GroupViT-S (4, then 2)
GROUPVIT = ("model.vision.kind=groupvit", "model.vision.depths=[1,1]", "model.vision.group_tokens=[4,0]",
            "model.vision.output_groups=[4,4]")
GROUPVIT_2 = ("model.vision.kind=groupvit", "model.vision.depths=[1,1,1]", "model.vision.group_tokens=[4,2,0]",
              "model.vision.output_groups=[4,2,2]")


def _cfg(name: str, k: int, tower: tuple[str, ...] = ()):
    return resolve("micro", micro_sizes() + micro_objective(name) + [f"train.batch_size={B}", f"train.accumulation={k}",
                                                                    "model.sync_batchnorm=true", *tower])


def _prepare(name: str, k: int = 1, tower: tuple[str, ...] = ()):
    """(cfg, step module, global batch) in float64 for the objective ``name`` (image tower: the
    micro ViT, or ``tower``'s overrides): the batch from the real loader (two views, labels: what the
    objective asks for), ProtoCLIP with a random episode."""
    cfg = _cfg(name, k, tower)
    objective_cls = REGISTRY[name][1]
    torch.manual_seed(0)
    model = build_model(cfg).double()
    objective = build_objective(cfg.objective, cfg, label_space=label_space_for(cfg)).double()
    data = train_loader(cfg, model.tokenizer, views=objective_cls.views, labels=objective_cls.label_request(cfg))
    batch = next(iter(data))
    batch = batch.with_pixels(batch.pixels.double())
    if name == "protoclip":  # an episode's prototypes and the batch's episode positions
        oc = cfg.objective
        g = torch.Generator().manual_seed(3)
        m, d = oc.episode_size, cfg.model.proto_dim
        k_ext = oc.k_ext if oc.use_ext else 1
        labels = torch.stack([torch.randint(0, oc.clusters, (m,), generator=g)] * 2
                             + [torch.randint(0, k_ext, (m,), generator=g)], 1)
        state = {}
        for direction, k in (("i2t", oc.clusters), ("t2i", oc.clusters), ("i2e", k_ext), ("t2e", k_ext)):
            state[f"{direction}_centroids"] = torch.nn.functional.normalize(
                torch.randn(k, d, generator=g, dtype=torch.float64), dim=-1)
            state[f"{direction}_valid"] = torch.ones(k, dtype=torch.bool)
        objective.set_episode(max(oc.warmup_episodes, 1), labels, **state)
        batch.episode = torch.arange(B) * 3 % m
    return cfg, TrainStep(model, objective), batch


def _result(step: TrainStep, terms: dict) -> tuple[dict, dict, dict]:
    grads = {n.removeprefix("module."): p.grad.detach().clone() for n, p in step.named_parameters()
             if p.grad is not None}
    stats = {k: v.detach().clone() for k, v in step.state_dict().items() if "running_" in k}
    return {k: torch.as_tensor(v).detach().double() for k, v in terms.items()}, grads, stats


def _whole_batch(name: str, tower: tuple[str, ...] = ()):
    _, step, batch = _prepare(name, tower=tower)
    terms = step(batch)
    terms["loss"].backward()
    return _result(step, terms)


def _assert_same(got, want, what: str) -> None:
    for part, a, b in zip(("term", "gradient", "BatchNorm statistic"), got, want):
        assert set(a) == set(b), (what, part, set(a) ^ set(b))
        for key in b:
            torch.testing.assert_close(a[key], b[key], rtol=1e-10, atol=1e-10, msg=f"{what}: {part} {key}")
    assert any("vision" in n for n in want[1]), what  # the towers got gradients through the cache


@pytest.mark.parametrize("name", list(REGISTRY))
def test_k_micro_batches_equal_the_whole_batch(name):
    want = _whole_batch(name)
    cfg, step, batch = _prepare(name, k=4)
    towers, heads = wrap_passes(step, DistContext(), cfg)
    tower_buffers = BufferSnapshot(online_towers(step.model))
    before = copy.deepcopy(tower_buffers.module.state_dict())
    got = _result(step, cached_step(towers, heads, batch, 4, tower_buffers, CPU))
    _assert_same(got, want, name)
    if name == "cmsf":  # the target tower ran once (pass 1): its buffers moved; the online towers' none
        assert all(torch.equal(v, before[k]) for k, v in tower_buffers.module.state_dict().items())


@pytest.mark.parametrize("name", ["clip", "xclip"])
@pytest.mark.parametrize("stages", [1, 2])
def test_k_micro_batches_equal_the_whole_batch_with_a_groupvit_tower(name, stages, monkeypatch):
    """GroupViT's tower holds no batch statistic, so its k-micro-batch step is the whole batch's. Its
    training-time Gumbel assignment draws noise per row, as dropout does: with one grouping stage the
    k micro-batches draw the whole batch's noise (consecutive in the CPU generator); with two the
    draws interleave otherwise, so that case runs without the noise (the hard arg-max assignment)."""
    tower = GROUPVIT if stages == 1 else GROUPVIT_2
    if stages == 2:
        from transformers.models.groupvit import modeling_groupvit as hf

        monkeypatch.setattr(hf, "gumbel_softmax", lambda logits, tau=1, hard=False, dim=-1:
                            hf.hard_softmax(logits, dim) if hard else logits.softmax(dim))
    want = _whole_batch(name, tower)
    cfg, step, batch = _prepare(name, k=4, tower=tower)
    assert cfg.model.vision.kind == "groupvit"
    towers, heads = wrap_passes(step, DistContext(), cfg)
    got = _result(step, cached_step(towers, heads, batch, 4, BufferSnapshot(online_towers(step.model)), CPU))
    _assert_same(got, want, f"{name} groupvit")
    assert any(f".stages.{stages - 1}.downsample." in n for n in want[1])  # the last grouping block got gradients


def _ranks(rank: int, world: int, names: list[str]):
    out = {}
    for name in names:
        cfg, step, batch = _prepare(name, k=2)
        ctx = DistContext(rank, world)
        module = wrap(step, ctx, cfg)  # global-batch BatchNorm in the heads, no DDP around the step
        assert module is step
        towers, heads = wrap_passes(step, ctx, cfg)
        n = B // world
        local = batch.rows(rank * n, (rank + 1) * n)
        terms = cached_step(towers, heads, local, 2, BufferSnapshot(online_towers(step.model)), CPU)
        out[name] = _result(step, terms)
    return out


@pytest.mark.slow
def test_two_ranks_with_k_2_equal_one_process_with_the_whole_batch():
    names = list(REGISTRY)
    results = run_ranks(_ranks, world_size=2, args=(names,), timeout=400)
    for name in names:
        want = _whole_batch(name)
        # DDP's objective is the mean of the ranks' losses (each rank's rows against the gathered batch)
        loss = torch.stack([per_rank[name][0]["loss"] for per_rank in results]).mean()
        torch.testing.assert_close(loss, want[0]["loss"], rtol=1e-10, atol=1e-10, msg=name)
        for rank, per_rank in enumerate(results):  # gradients averaged by DDP, head BatchNorm synchronised
            _, grads, stats = per_rank[name]
            _assert_same(({}, grads, stats), ({}, *want[1:]), f"{name} rank {rank}")


def test_exact_accumulation_needs_ddp():
    with pytest.raises(Exception, match="accumulation_mode exact is not supported with strategy fsdp"):
        resolve("micro", ["train.accumulation=2", "train.strategy=fsdp"])
    resolve("micro", ["train.accumulation=2", "train.strategy=fsdp", "train.accumulation_mode=independent"])
