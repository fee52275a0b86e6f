"""The test that settles distributed correctness (docs/design.md): 2 gloo ranks with half a batch each
give the same loss and the same gradients as 1 process with the whole batch, in float64.

Spawning processes is the expensive part, so each group of checks runs in ONE 2-rank spawn whose
results are shared by the parametrised tests (module-scoped fixtures).

Adding an objective: add one line to FUNCTIONAL_CASES (inputs: ``img``/``txt`` [B, D] embeddings,
``img_logits``/``txt_logits`` [B, K] head outputs, shared scalars ``scale`` and ``bias``).
"""

from __future__ import annotations

import json

import pytest
import torch

from nclip import distributed as collectives
from nclip.objectives import functional
from nclip.train.logbook import WALL_CLOCK

from conftest import micro_sizes
from distributed_utils import combine_ranks, loss_and_grads, run_ranks, split_rows

pytestmark = pytest.mark.slow  # every test here trains or spawns processes

WORLD = 2
B, DIM, K = 8, 6, 5
ROW_KEYS = ("img", "txt", "img_logits", "txt_logits")


# name -> loss(inputs) of the functional API; every registered objective's module is checked the
# same way in tests/objectives/test_registry.py
FUNCTIONAL_CASES = {
    "clip": lambda x: functional.clip_terms(x["img"], x["txt"], x["scale"])["loss"],
    "nclip": lambda x: functional.nclip_terms(x["img_logits"], x["txt_logits"], 0.5, 1.5)["loss"],
    "xclip": lambda x: functional.xclip_loss(x["img"], x["txt"], x["img_logits"], x["txt_logits"], x["scale"]),
    "unified/none": lambda x: functional.unified_terms(x["img_logits"], x["txt_logits"], 0.7, 0.5, 0.5, 1.5)["loss"],
    "unified/sinkhorn": lambda x: functional.unified_terms(x["img_logits"], x["txt_logits"], 0.7, 0.5,
                                                          uniform="sinkhorn")["loss"],
    "unified/batch_softmax": lambda x: functional.unified_terms(x["img_logits"], x["txt_logits"], 0.7, 0.5,
                                                       uniform="batch_softmax")["loss"],
    "yclip": lambda x: functional.yclip_terms(x["img_logits"], x["txt_logits"], x["scale"])["loss"],
    "siglip": lambda x: functional.siglip_terms(x["img"], x["txt"], x["scale"], x["bias"])["loss"],
}


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return {"img": r(B, DIM), "txt": r(B, DIM), "img_logits": 2 * r(B, K), "txt_logits": 2 * r(B, K),
            "scale": torch.tensor(7.0, dtype=torch.float64), "bias": torch.tensor(-2.0, dtype=torch.float64)}


# --------------------------------------------------------------------------------------------
# rank functions (module level: the spawned children import them)
# --------------------------------------------------------------------------------------------


def _functional_rank(rank: int, world: int):
    out = {}
    for name, fn in FUNCTIONAL_CASES.items():
        out[name] = loss_and_grads(fn, split_rows(_inputs(), ROW_KEYS, rank, world))
    # the collectives themselves
    x = torch.arange(6, dtype=torch.float64).reshape(3, 2) + 10 * rank
    x.requires_grad_(True)
    w = torch.tensor([[1.0, -2.0]], dtype=torch.float64) * (rank + 1)
    gathered = collectives.gather_with_grad(x)  # [6, 2]
    (gathered * torch.arange(12, dtype=torch.float64).reshape(6, 2)).sum().mul(rank + 1).backward()
    y = torch.tensor([1.0, 2.0], dtype=torch.float64) * (rank + 1)
    y.requires_grad_(True)
    mean = collectives.all_reduce_mean_with_grad(y)
    (mean * w[0]).sum().backward()
    counts = collectives.all_reduce_sum_no_grad(torch.tensor([rank + 1.0]))
    means = collectives.all_reduce_mean_no_grad(torch.tensor([rank + 1.0]))
    src = collectives.broadcast_no_grad(torch.tensor([rank + 5.0]))
    out["collectives"] = {"gathered": gathered.detach(), "x_grad": x.grad, "mean": mean.detach(),
                          "y_grad": y.grad, "sum": counts, "mean_ng": means, "bcast": src,
                          "rank": collectives.rank(), "world": collectives.world_size()}
    return out


def _all_rank(rank: int, world: int, root: str):
    """Everything this file checks on 2 ranks, in ONE spawn (starting processes dominates)."""
    return {"functional": _functional_rank(rank, world), "model": _model_rank(rank, world),
            "loop": _loop_rank(rank, world, root)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    # the process group is created as under torchrun: env variables + nclip.train.launch.setup
    return root, run_ranks(_all_rank, WORLD, args=(str(root),), init="torchrun")


@pytest.fixture(scope="module")
def functional_results(ranks):
    return [r["functional"] for r in ranks[1]]


@pytest.mark.parametrize("name", list(FUNCTIONAL_CASES))
def test_functional_loss_and_grads_match_single_process(functional_results, name):
    ref_loss, ref_grads = loss_and_grads(FUNCTIONAL_CASES[name], split_rows(_inputs(), ROW_KEYS, 0, 1))
    loss, grads = combine_ranks([r[name] for r in functional_results], ROW_KEYS)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-9, atol=1e-12, msg=f"{name}: d/d{k}")
    assert any(g.abs().sum() > 0 for g in ref_grads.values())


def test_collectives(functional_results):
    c0, c1 = (r["collectives"] for r in functional_results)
    assert (c0["rank"], c0["world"], c1["rank"], c1["world"]) == (0, 2, 1, 2)
    x_all = torch.cat([torch.arange(6, dtype=torch.float64).reshape(3, 2) + 10 * r for r in range(2)])
    torch.testing.assert_close(c0["gathered"], x_all)
    torch.testing.assert_close(c1["gathered"], x_all)
    # rank r's loss is (r+1)·Σ gathered ⊙ M: the gradient of the rows of rank q is Σ_r (r+1)·M_q
    m = torch.arange(12, dtype=torch.float64).reshape(6, 2)
    torch.testing.assert_close(c0["x_grad"], 3 * m[:3])
    torch.testing.assert_close(c1["x_grad"], 3 * m[3:])
    # mean over ranks of y_r = (r+1)·[1, 2] is 1.5·[1, 2]; rank r's loss (mean · w_r) with
    # w_r = (r+1)·[1, -2]: d(mean_r L_r)/dy_q = (1/W)·Σ_r w_r/W, DDP multiplies by 1/W, so the
    # collective returns Σ_r w_r / W = 1.5·[1, -2] on both ranks
    torch.testing.assert_close(c0["mean"], torch.tensor([1.5, 3.0], dtype=torch.float64))
    torch.testing.assert_close(c0["y_grad"], torch.tensor([1.5, -3.0], dtype=torch.float64))
    torch.testing.assert_close(c1["y_grad"], torch.tensor([1.5, -3.0], dtype=torch.float64))
    assert float(c0["sum"]) == 3.0 and float(c1["mean_ng"]) == 1.5
    assert float(c0["bcast"]) == float(c1["bcast"]) == 5.0


def test_collectives_are_identities_without_a_process_group():
    x = torch.randn(3, 2)
    assert collectives.gather_with_grad(x) is x and collectives.all_reduce_mean_with_grad(x) is x
    assert collectives.world_size() == 1 and collectives.rank() == 0


# --------------------------------------------------------------------------------------------
# a real (tiny) dual encoder with global-batch BatchNorm in the nCLIP heads, under DDP and FSDP2
# --------------------------------------------------------------------------------------------

MODEL_OVERRIDES = micro_sizes() + ["objective.name=xclip", "model.sync_batchnorm=true"]
# the image towers checked: the micro ViT (BatchNorm in the heads only) and CLIP's modified ResNet
# (issue 27.3: BatchNorm2d throughout the tower, global-batch statistics under model.sync_batchnorm)
MODEL_TOWERS = {
    "vit": [],
    "clip_resnet": ["model.vision.kind=clip_resnet", "model.vision.embedding_size=8", "model.vision.depths=[1,2]",
                    "model.vision.hidden_sizes=[16,32]"],
}
BN_KINDS = {"vit": ["GlobalBatchNorm1d"], "clip_resnet": ["GlobalBatchNorm1d", "GlobalBatchNorm2d"]}
CAPTIONS = ["a red circle", "two blue squares", "a green star", "a small yellow triangle",
            "three big circles", "a purple cross", "an orange heart", "one grey square"]


def _model_and_batch(strategy: str = "ddp", tower: str = "vit"):
    from nclip.batch import Batch
    from nclip.config import resolve
    from nclip.models import build_model
    from nclip.objectives import build_objective
    from nclip.train.step import TrainStep

    cfg = resolve("micro", MODEL_OVERRIDES + MODEL_TOWERS[tower] + [f"train.strategy={strategy}"])
    torch.manual_seed(0)
    model = build_model(cfg).double()
    for m in model.vision.modules():  # γ ≠ 0 (clip_resnet starts its blocks' last BN at 0): every branch learns
        if isinstance(m, torch.nn.BatchNorm2d):
            torch.nn.init.uniform_(m.weight, 0.5, 1.5)
    step = TrainStep(model, build_objective(cfg.objective).double())
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(B, 3, 16, 16, generator=g, dtype=torch.float64)
    ids, mask = model.tokenizer(CAPTIONS)
    return cfg, step, Batch(pixels, ids, mask)


def _grads(module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in module.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            out[name.removeprefix("module.")] = g.detach().clone()
    return out


def _bn_stats(step) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in step.state_dict().items() if "running_" in k}


def _model_rank(rank: int, world: int):
    from nclip.train.launch import DistContext, sync_replicated_grads, wrap

    results = {}
    for tower in MODEL_TOWERS:
        results[tower] = {}
        for strategy in ("ddp", "fsdp"):
            cfg, step, batch = _model_and_batch(strategy, tower)
            module = wrap(step, DistContext(rank, world), cfg)
            n = B // world
            terms = module(batch.rows(rank * n, (rank + 1) * n))  # a Batch through DDP's and FSDP2's forward
            terms["loss"].backward()
            sync_replicated_grads(module)
            bn = {}
            if strategy == "ddp":  # FSDP2 keeps buffers whole; DDP's are the interesting ones
                bn = _bn_stats(step)
                kinds = sorted({type(m).__name__ for m in step.modules() if "BatchNorm" in type(m).__name__})
                results[tower]["bn_kinds"] = kinds
            results[tower][strategy] = (terms["loss"].detach(), _grads(module), bn)
    return results


@pytest.fixture(scope="module")
def model_results(ranks):
    return [r["model"] for r in ranks[1]]


def _model_reference(tower: str):
    _, step, batch = _model_and_batch(tower=tower)
    terms = step(batch)
    terms["loss"].backward()
    return terms["loss"].detach(), _grads(step), _bn_stats(step)


@pytest.mark.parametrize("tower", list(MODEL_TOWERS))
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_dual_encoder_grads_match_single_process(model_results, strategy, tower):
    ref_loss, ref_grads, ref_bn = _model_reference(tower)
    model_results = [r[tower] for r in model_results]
    losses = [r[strategy][0] for r in model_results]
    torch.testing.assert_close(torch.stack(losses).mean(), ref_loss, rtol=1e-10, atol=1e-12)
    for rank_result in model_results:
        grads = rank_result[strategy][1]
        assert set(grads) == set(ref_grads)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-8, atol=1e-11, msg=f"{strategy}: {name}")
    if strategy == "ddp":
        assert model_results[0]["bn_kinds"] == BN_KINDS[tower]
        for rank_result in model_results:  # running statistics of the global batch, on every rank
            for name, v in ref_bn.items():
                torch.testing.assert_close(rank_result["ddp"][2][name], v, rtol=1e-10, atol=1e-12, msg=name)
    assert any("heads.nclip." in n for n in ref_grads) and any("vision" in n for n in ref_grads)


# --------------------------------------------------------------------------------------------
# the training loop itself on 2 ranks: global metrics, rank-0 files, FSDP checkpoints and resume
# --------------------------------------------------------------------------------------------

RUN_OVERRIDES = ["train.steps=4", "train.batch_size=8", "train.log_every=1", "train.checkpoint_every=2",
                 "train.warmup_steps=1", "data.train_length=64", "train.threads=1"]



def _run_cfg(*extra):
    from nclip.config import resolve

    return resolve("micro", RUN_OVERRIDES + list(extra))


def _loop_rank(rank: int, world: int, root: str):
    import shutil
    from pathlib import Path

    from nclip.train.loop import train

    out = {}
    train(_run_cfg(), Path(root) / "ddp", progress=False, evaluate=False)
    fsdp = Path(root) / "fsdp"
    train(_run_cfg("train.strategy=fsdp"), fsdp, progress=False, evaluate=False)
    torch.distributed.barrier()
    if rank == 0:  # keep the full run's log, pretend the run died after step 2
        out["fsdp_full"] = (fsdp / "metrics.jsonl").read_text()
        shutil.rmtree(fsdp / "checkpoints" / "step_00000004")
    torch.distributed.barrier()
    train(_run_cfg("train.strategy=fsdp"), fsdp, resume=True, progress=False, evaluate=False)
    return out


def _metrics(text: str) -> list[dict]:
    rows = [json.loads(line) for line in text.splitlines()]
    for r in rows:
        for key in WALL_CLOCK:
            r.pop(key, None)
    return rows


def test_training_loop_on_two_ranks(ranks, tmp_path):
    from nclip.train.loop import train

    root, results = ranks
    train(_run_cfg(), tmp_path / "single", progress=False, evaluate=False)
    single = _metrics((tmp_path / "single" / "metrics.jsonl").read_text())
    for name in ("ddp", "fsdp"):
        run = root / name
        rows = _metrics((run / "metrics.jsonl").read_text())
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        for a, b in zip(rows, single):  # logged terms are global: they match one process
            assert set(a) == set(b)
            for k in b:
                assert a[k] == pytest.approx(b[k], rel=1e-4, abs=5e-5), (name, a["step"], k)
        state = torch.load(run / "checkpoints" / "step_00000004" / "state.pt", weights_only=True)
        assert state["world_size"] == 2 and len(state["rng"]) == 2 and len(state["data"]) == 2
        assert (run / "model" / "model.safetensors").is_file()
    # FSDP resumed from step 2 writes what the uninterrupted FSDP run wrote
    resumed = _metrics((root / "fsdp" / "metrics.jsonl").read_text())
    full = _metrics(results[0]["loop"]["fsdp_full"])
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(resumed, full):
        for k in b:
            assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-7), (a["step"], k)
