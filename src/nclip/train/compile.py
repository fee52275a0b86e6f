"""``train.compile``: the training step compiled by ``torch.compile``, or eager where that fails.

What is compiled (:func:`compile_step`): the whole forward of the step as one region — the towers,
the heads, the cast to float32 and the objective (:class:`nclip.train.step.TrainStep`; under exact
accumulation its two halves, ``TowerPass`` and ``HeadPass``, each a region). One region lets
Inductor fuse the heads and the objective's elementwise work (softmaxes, entropies, the cast) as it
fuses the towers', and costs one compilation. The objective still computes in float32: its inputs
are cast inside the region, and Inductor keeps the dtypes of the ops it fuses. The step's backward
is compiled with its forward (AOTAutograd); the optimizer, the skip gate and ``after_step`` stay
eager, and so does evaluation (while training and at the end: batches of other shapes, which would
each cost a compilation). :func:`compile_towers` compiles the towers alone (the towers-only column
of ``benchmarks/compile_step.py``; the bench's hand loop compiles the step as the trainer does).

Modules are compiled in place (``nn.Module.compile``): parameters and state-dict keys stay what they
were, so checkpoints, resume and the saved model are the same with or without compilation. The
trainer compiles after the memory check (:mod:`nclip.train.memory_check`), whose probe steps at
other batch sizes would otherwise compile graphs of their own, and the second of them would make
dynamo recompile the step for a dynamic batch size: every step of a run has the shapes of its batch,
so the run compiles one graph, static, at that batch. A Python int attribute of a module that
changes from step to step (an objective's step number, set by ``before_step`` for a scheduled loss
weight) would be a constant of the graph, and so a recompilation per step until dynamo's recompile
limit (8) runs the whole step eagerly; :func:`compile_step` lets dynamo make such an int symbolic
after its first change instead (``allow_unspec_int_on_nn_module``): one recompilation.

A graph break splits the region, and each piece is compiled apart, with the Python between them run
eagerly; :func:`graph_breaks` lists them (``torch._dynamo.explain``; the table per objective is in
docs/performance.md).

Compilation is lazy in torch (it happens at the first call), and a build of torch may lack what its
backend needs (a C++ compiler for Inductor on the CPU, Triton on a GPU). So a small function is
compiled and run forward and backward first, on the step's device; if that fails, the run trains
eagerly after one line on stderr saying why.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

BACKEND = "inductor"  # torch.compile's backend (tests count graphs with a backend of their own)


def _probe(device: torch.device) -> None:
    """Compile and run a tiny forward and backward on ``device``; raises where torch.compile cannot."""
    def f(x):
        return torch.nn.functional.gelu(x @ x.T).sum()

    x = torch.randn(8, 8, device=device, requires_grad=True)
    torch.compile(f, backend=BACKEND)(x).backward()


def _can_compile(module: nn.Module) -> bool:
    """Does torch.compile work on ``module``'s device? False after a one-line warning."""
    try:
        _probe(next(module.parameters()).device)
    except Exception as e:  # any backend failure: a missing compiler, an unsupported platform
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        print(f"nclip: warning: train.compile: torch.compile failed here ({type(e).__name__}: {reason}); "
              "training eagerly", file=sys.stderr)
        return False
    return True


def compile_step(step: nn.Module, passes: tuple[nn.Module, ...] | None = None) -> bool:
    """Compile the training step in place: ``step`` (a ``TrainStep``, FSDP2-sharded or not) as one
    region, or, under exact accumulation, each of ``passes`` (``TowerPass`` and ``HeadPass``,
    DDP-wrapped or not) instead. False (after a one-line warning) where torch.compile fails here,
    leaving the step eager."""
    if not _can_compile(step):
        return False
    if hasattr(torch._dynamo.config, "allow_unspec_int_on_nn_module"):  # module docstring; read at compilation
        torch._dynamo.config.allow_unspec_int_on_nn_module = True
    for module in passes if passes is not None else (step,):
        getattr(module, "module", module).compile(backend=BACKEND)  # inside DDP: its hooks stay eager
    return True


def compile_towers(model: nn.Module) -> bool:
    """Compile ``model``'s towers in place; False (after a one-line warning) where torch.compile
    fails here, leaving them eager."""
    if not _can_compile(model):
        return False
    for tower in model.towers().values():  # with the towers heads hold (CMSF's momentum copy)
        tower.compile(backend=BACKEND)
    return True


def graph_breaks(module: nn.Module, *inputs) -> tuple[int, list[tuple[str, str]]]:
    """(graphs, breaks) of ``module(*inputs)`` as torch.compile traces it (``torch._dynamo.explain``:
    traced, not compiled; the call runs once, with its side effects on buffers): the number of graphs
    the call is split into, and each distinct break as (reason, ``file:line`` of the innermost frame
    that made it). Resets dynamo's caches."""
    torch._dynamo.reset()
    found = torch._dynamo.explain(module)(*inputs)
    torch._dynamo.reset()
    breaks: dict[tuple[str, str], None] = {}
    for item in found.break_reasons:
        frame = item.user_stack[-1] if item.user_stack else None
        where = f"{frame.filename.split('src/')[-1]}:{frame.lineno}" if frame is not None else "?"
        breaks[(item.reason.strip().splitlines()[0], where)] = None
    return found.graph_count, list(breaks)
