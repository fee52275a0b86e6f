"""``train.compile``: graph breaks and recompilations per objective, and what compiling pays.

    python benchmarks/compile_step.py table [--objectives clip xclip ...] [--steps 6]
    python benchmarks/compile_step.py time [--preset tiny] [--objective NAME] [--steps 5] [--repeats 3]

``table``: for every registered objective (micro sizes, batch 8, CPU), the graphs that
``torch.compile`` splits the training step into (:func:`nclip.train.compile.graph_breaks`, i.e.
``torch._dynamo.explain`` of :class:`nclip.train.step.TrainStep`), each distinct break with the
line that makes it, and the graphs compiled again in steps 2 to ``--steps`` of a real ``train()`` run
with ``train.compile=true`` (dynamo's graphs run eagerly, so no compiler is needed) with the
guards that failed. A markdown table, for docs/performance.md.

``time``: the step time (forward, backward, AdamW; one thread, process CPU time) of the same model,
batch and optimizer run eagerly, with its towers compiled (:func:`nclip.train.compile.compile_towers`)
and with the whole step compiled (:func:`nclip.train.compile.compile_step`), each built once with the
same seed and warmed up (compilation untimed), then timed in alternating windows; ratios are the
median of the per-repeat ratios. ``before_step`` is not called (λ at its base: the bench's hand loop
does the same). Nothing is asserted.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

import nclip.train.compile as compile_mod  # noqa: E402
import nclip.train.loop as loop_mod  # noqa: E402
from nclip.batch import Batch  # noqa: E402
from nclip.config import load_preset, resolve  # noqa: E402
from nclip.data.labels import label_space_for  # noqa: E402
from nclip.models import build_model  # noqa: E402
from nclip.objectives import REGISTRY, build_objective  # noqa: E402
from nclip.train.memory_check import probe_batch  # noqa: E402
from nclip.train.optim import build_optimizer  # noqa: E402
from nclip.train.step import TrainStep  # noqa: E402


def micro_sizes() -> list[str]:
    """presets/micro.yaml's data and model sizes as overrides (as tests/conftest.py makes them)."""
    raw = load_preset("micro")
    sizes = {"data": {k: v for k, v in raw["data"].items() if k != "source"}, "model": raw["model"]}

    def leaves(tree: dict, prefix: str = ""):
        for key, value in tree.items():
            yield from leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else [(f"{prefix}{key}", value)]

    return [f"{key}={json.dumps(value)}" for key, value in leaves(sizes)]


def build(cfg, seed: int = 0) -> tuple[TrainStep, torch.optim.Optimizer, Batch]:
    """The step, its AdamW and a stand-in batch (normalised pixels), built as the trainer builds them."""
    torch.manual_seed(seed)
    model = build_model(cfg, pretrained_text=False)
    objective = build_objective(cfg.objective, cfg, label_space=label_space_for(cfg))
    kind = REGISTRY[cfg.objective.name][1]
    torch.manual_seed(seed + 1)
    batch = probe_batch(model, cfg, cfg.train.batch_size, kind.views, kind.label_request(cfg), torch.device("cpu"))
    return TrainStep(model, objective), build_optimizer([model, objective], cfg.train), batch


class Graphs:
    """A torch.compile backend that counts graphs and runs them eagerly."""

    def __init__(self):
        self.count = 0

    def __call__(self, gm, example_inputs):
        self.count += 1
        return gm.forward


def recompilations(cfg, steps: int) -> tuple[int, list[str]]:
    """(graphs compiled in steps 2..``steps`` of a compiled ``train()`` run, the guards that failed)."""
    from torch._dynamo.utils import guard_failures

    graphs, per_step, failed = Graphs(), [], set()
    compile_mod.BACKEND, compile_mod._probe = graphs, lambda device: None
    real_step = loop_mod._step

    def step(run, index, batch):
        before = graphs.count
        if index == 1:
            guard_failures.clear()  # those of the first step: buffers sized lazily, a first value
        result = real_step(run, index, batch)
        per_step.append(graphs.count - before)
        if index > 0:
            failed.update(_guard(reason) for reasons in guard_failures.values() for reason in reasons)
        return result

    loop_mod._step = step
    torch._dynamo.reset()
    try:
        with tempfile.TemporaryDirectory() as tmp, open(os.devnull, "w") as quiet, \
                contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            loop_mod.train(cfg, Path(tmp) / "run", progress=False, evaluate=False)
    finally:
        loop_mod._step = real_step
        torch._dynamo.reset()
    return sum(per_step[1:]), sorted(failed)


def _guard(reason: str) -> str:
    """A failed guard without its frame number and value: ``self.step == 3  # ... nclip.py:37 in f`` ->
    ``self.step == … (nclip/objectives/nclip.py:37)``."""
    line = reason.strip().splitlines()[0]
    guard, _, where = line.partition("#")
    guard = re.sub(r"^\d+/\d+: ", "", guard.strip())
    guard = re.sub(r"(==|!=|<=|>=|<|>) *-?[\d.]+$", r"\1 …", guard)
    found = re.search(r"(nclip/[\w/]+\.py:\d+)", where)
    return f"{guard} ({found.group(1)})" if found else guard


def table(names: list[str], steps: int) -> None:
    print("| objective | graphs | breaks (distinct: reason at line) | graphs recompiled in steps 2–"
          f"{steps} (failed guard) |")
    print("| --- | ---: | --- | --- |")
    for name in names:
        cfg = resolve("micro", micro_sizes() + [f"objective.name={name}", "train.batch_size=8", f"train.steps={steps}",
                                                "train.log_every=100", "train.checkpoint_every=100", "train.threads=1",
                                                "data.train_length=64", "train.compile=true", "train.eval_every=0"])
        step, _, batch = build(cfg)
        step.objective.before_step(1, steps)
        graphs, breaks = compile_mod.graph_breaks(step, batch)
        again, failed = recompilations(cfg, steps)
        where = "; ".join(f"{reason[:60]} at `{line}`" for reason, line in breaks) or "none"
        guards = f" ({'; '.join(f'`{g}`' for g in failed)})" if failed else ""
        print(f"| {name} | {graphs} | {where} | {again}{guards} |", flush=True)


def window(step: TrainStep, optimizer, batch: Batch, steps: int) -> float:
    """Process CPU seconds per step over ``steps`` steps."""
    t0 = time.process_time()
    for _ in range(steps):
        step(batch)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return (time.process_time() - t0) / steps


def timing(preset: str, objective: str, steps: int, repeats: int, warmup: int) -> None:
    torch.set_num_threads(1)
    overrides = ([f"objective.name={objective}"] if objective else []) + (micro_sizes() if preset == "micro" else [])
    cfg = resolve(preset, overrides)
    objective = cfg.objective.name
    modes = {}
    for mode in ("eager", "towers", "step"):
        step, optimizer, batch = build(cfg)
        if mode == "towers":
            assert compile_mod.compile_towers(step.model)
        elif mode == "step":
            assert compile_mod.compile_step(step)
        step.train()
        t0 = time.perf_counter()
        window(step, optimizer, batch, warmup)  # the first steps compile (and make AdamW's state): untimed
        print(f"{mode}: warm-up ({warmup} steps, compilation included) {time.perf_counter() - t0:.1f} s wall",
              file=sys.stderr, flush=True)
        modes[mode] = (step, optimizer, batch)
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(repeats):
        for mode, parts in modes.items():
            times[mode].append(window(*parts, steps))
    med = {mode: statistics.median(t) for mode, t in times.items()}
    ratios = {mode: statistics.median(e / t for e, t in zip(times["eager"], times[mode])) for mode in modes}
    print(f"preset {preset}, objective {objective}, batch {cfg.train.batch_size}, {steps} steps x {repeats} "
          f"repeats, 1 thread, process CPU time, torch {torch.__version__}")
    for mode in modes:
        print(f"  {mode:7s} {med[mode] * 1e3:8.1f} ms/step   speed-up over eager {ratios[mode]:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    t = sub.add_parser("table")
    t.add_argument("--objectives", nargs="*", default=list(REGISTRY))
    t.add_argument("--steps", type=int, default=6)
    s = sub.add_parser("time")
    s.add_argument("--preset", default="tiny")
    s.add_argument("--objective", help="default: the preset's (clip-tiny: clip, tiny: xclip)")
    s.add_argument("--steps", type=int, default=5)
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    if args.what == "table":
        table(args.objectives, args.steps)
    else:
        timing(args.preset, args.objective, args.steps, args.repeats, args.warmup)


if __name__ == "__main__":
    main()
