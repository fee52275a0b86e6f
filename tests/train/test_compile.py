"""train.compile: the training step compiled in place as one region (same state-dict keys, same loss
and gradients as eager to float tolerance), after the memory check's probe so that a run compiles one
graph, at its batch, with no graph break for clip, siglip and xclip; eager with one warning line
where torch.compile fails (issue 32.7)."""

from __future__ import annotations

import json

import pytest
import torch

import nclip.train.compile as compile_mod
import nclip.train.memory_check as memory_check
from nclip.batch import Batch
from nclip.config import resolve
from nclip.data.labels import label_space_for
from nclip.models import build_model
from nclip.objectives import REGISTRY, build_objective
from nclip.train.loop import train
from nclip.train.step import TrainStep

from conftest import micro_sizes

pytestmark = pytest.mark.usefixtures("one_thread")

OVERRIDES = micro_sizes() + ["train.steps=2", "train.batch_size=8", "train.warmup_steps=1", "train.log_every=1",
                             "train.threads=1", "data.train_length=64"]

def _step(name: str) -> tuple[TrainStep, Batch]:
    """The training step of ``name`` at micro sizes as the trainer builds it, and a batch of 8 for it."""
    cfg = resolve("micro", OVERRIDES + [f"objective.name={name}"])
    torch.manual_seed(0)
    model = build_model(cfg, pretrained_text=False)
    objective = build_objective(cfg.objective, cfg, label_space=label_space_for(cfg))
    request = REGISTRY[name][1].label_request(cfg)
    batch = memory_check.probe_batch(model, cfg, 8, REGISTRY[name][1].views, request, torch.device("cpu"))
    # distinct captions: identical rows would leave the nCLIP heads' BatchNorm a zero variance, whose
    # gradient is rounding noise divided by sqrt(eps) (eager and compiled would then disagree by 10 %)
    batch.ids = torch.randint(1000, 5000, batch.ids.shape, generator=torch.Generator().manual_seed(1))
    objective.before_step(1, cfg.train.steps)  # a step after the first, as the trainer calls it
    return TrainStep(model, objective), batch


class _Graphs:
    """A torch.compile backend that records the shapes of each graph's tensor inputs and runs it eagerly."""

    def __init__(self):
        self.inputs: list[list[tuple]] = []

    def __call__(self, gm, example_inputs):
        self.inputs.append([tuple(t.shape) for t in example_inputs if torch.is_tensor(t)])
        return gm.forward


@pytest.fixture(autouse=True)
def _dynamo_config():
    """compile_step sets a dynamo option for the process: put it back after each test (monkeypatch
    cannot: its undo deletes a torch config entry)."""
    before = torch._dynamo.config.allow_unspec_int_on_nn_module
    yield
    torch._dynamo.config.allow_unspec_int_on_nn_module = before


def test_a_step_number_set_between_steps_costs_one_recompilation(monkeypatch):
    """An int attribute that changes every step (an objective's step, set by before_step) is made
    symbolic after its first change: one recompilation, not one per step until dynamo's limit runs
    the step eagerly. The compiled values follow the attribute."""
    class Scheduled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(3))
            self.step = 0

        def forward(self, x):
            return self.weight * x * min(self.step / 4, 1.0)  # a warm-up ramp

    graphs = _Graphs()
    monkeypatch.setattr(compile_mod, "BACKEND", graphs)
    monkeypatch.setattr(compile_mod, "_probe", lambda device: None)
    torch._dynamo.config.allow_unspec_int_on_nn_module = False  # torch's default (the fixture puts it back)
    torch._dynamo.reset()
    module, x = Scheduled(), torch.arange(3.0)
    assert compile_mod.compile_step(module)
    for step in range(10):
        module.step = step
        assert torch.equal(module(x), torch.ones(3) * x * min(step / 4, 1.0)), step
    torch._dynamo.reset()
    assert len(graphs.inputs) == 2


def test_a_failing_compiler_leaves_the_step_eager_with_one_warning(monkeypatch, capsys):
    def broken(device):
        raise RuntimeError("no C++ compiler\nmore detail")

    monkeypatch.setattr(compile_mod, "_probe", broken)
    step, _ = _step("clip")
    assert not compile_mod.compile_step(step)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.compile" in err[0] and "no C++ compiler" in err[0] and "eagerly" in err[0]
    assert getattr(step, "_compiled_call_impl", None) is None


def test_a_run_with_a_failing_compiler_trains_as_eager(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_mod, "_probe", lambda device: (_ for _ in ()).throw(RuntimeError("nope")))
    losses = []
    for name, extra in (("eager", []), ("compiled", ["train.compile=true"])):
        train(resolve("micro", OVERRIDES + extra), tmp_path / name, progress=False, evaluate=False)
        losses.append([json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").open()])
    assert losses[0] == losses[1]


@pytest.mark.parametrize("name", ["clip", "siglip", "xclip"])
def test_a_compiled_run_compiles_one_graph_at_its_batch(name, tmp_path, monkeypatch):
    """The memory check probes batches 2 and 4: before the step is compiled, so that they make no
    graph; and the steps that follow reuse the first step's graph (no recompilation)."""
    graphs, probed = _Graphs(), []
    monkeypatch.setattr(compile_mod, "BACKEND", graphs)  # dynamo's graphs, run eagerly: no compiler needed
    monkeypatch.setattr(compile_mod, "_probe", lambda device: None)
    real_probe = memory_check._probe
    monkeypatch.setattr(memory_check, "_probe", lambda cfg, learner: probed.append(True) or real_probe(cfg, learner))
    monkeypatch.setattr(memory_check, "PESSIMISTIC_BYTES", 10**9)  # always probe
    monkeypatch.setattr(memory_check, "available_bytes", lambda device, ranks=1: (2.0**32, "MemAvailable"))
    torch._dynamo.reset()
    cfg = resolve("micro", OVERRIDES + [f"objective.name={name}", "train.compile=true", "train.steps=4"])
    train(cfg, tmp_path, progress=False, evaluate=False)
    torch._dynamo.reset()
    assert probed, "the memory check did not probe: the test would not see its batches"
    pixels = [[s for s in shapes if s[1:] == (3, 16, 16)] for shapes in graphs.inputs]
    assert pixels == [[(8, 3, 16, 16)]], f"graphs' pixel inputs {pixels}"


@pytest.mark.parametrize("name", ["clip", "siglip", "xclip"])
def test_no_graph_break_in_the_compiled_step(name):
    step, batch = _step(name)
    graphs, breaks = compile_mod.graph_breaks(step, batch)  # the Batch is the compiled step's one input
    assert (graphs, breaks) == (1, [])


def test_graph_breaks_are_found_and_located():
    """The check above can fail: a step that reads a tensor on the host breaks where it reads it."""
    class Reads(torch.nn.Module):
        def forward(self, x):
            y = x * 2
            if y.sum().item() > 0:  # a host read: dynamo cannot trace past it
                return y + 1
            return y - 1

    graphs, breaks = compile_mod.graph_breaks(Reads(), torch.ones(3))
    assert graphs == 2 and len(breaks) == 1
    assert breaks[0][1].endswith(f"test_compile.py:{Reads.forward.__code__.co_firstlineno + 2}"), breaks


@pytest.mark.slow
def test_the_compiled_step_gives_the_eager_loss_and_gradients():
    try:
        compile_mod._probe(torch.device("cpu"))
    except Exception as e:  # this torch build cannot compile: the fallback tests above cover it
        pytest.skip(f"torch.compile unavailable: {e}")
    step, batch = _step("xclip")  # towers, CLIP and nCLIP heads (BatchNorm), the objective
    keys = list(step.state_dict())
    found = []
    for compiled in (False, True):
        if compiled:
            assert compile_mod.compile_step(step)
        loss = step(batch)["loss"]
        loss.backward()
        found.append((loss.item(), {n: p.grad.clone() for n, p in step.named_parameters() if p.grad is not None}))
        step.zero_grad(set_to_none=True)
    assert list(step.state_dict()) == keys  # compiled in place: checkpoints are unchanged
    (eager, eager_grads), (compiled, compiled_grads) = found
    assert compiled == pytest.approx(eager, rel=1e-4, abs=1e-5)
    assert eager_grads.keys() == compiled_grads.keys()
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.slow
def test_a_compiled_run_trains_a_micro_step(tmp_path):
    result = train(resolve("micro", OVERRIDES + ["train.compile=true"]), tmp_path / "run", progress=False,
                   evaluate=False)
    assert result.steps == 2 and torch.isfinite(torch.tensor(result.metrics["loss"]))
