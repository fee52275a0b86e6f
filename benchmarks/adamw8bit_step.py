"""The host time of an ``adamw8bit`` step (nclip.train.lowbit): torchao's update is a Python loop
that calls a compiled kernel per parameter. On a GPU everything but the kernels' run is time the
host spends while the device may starve. Measured on the CPU with narrow tensors (width 64) in
ViT-B/16 xCLIP's count and layout (two 12-block towers, heads: ~410 tensors), so that the kernels'
own work is small and the loop's cost shows; the time inside the compiled graphs is read from the
profiler (``## Call CompiledFxGraph ##``) and taken off.

Compared: torchao's ``AdamW8bit``; nclip's gated subclass (the same loop, one more argument);
with ``--chunk N``, a grouped variant (one compiled call per chunk of N same-kind tensors,
unrolled by Dynamo; a prototype, here only: its first step compiles for half an hour on 2 cores);
torch's fused AdamW (float32 moments) for scale.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/adamw8bit_step.py [--repeats 20] [--chunk 32]
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
from torch.profiler import profile

from nclip.train.lowbit import _gated_update, _import_adamw8bit, _parts, gated_adamw8bit

WIDTH = 64


def _params() -> list[torch.nn.Parameter]:
    """~410 tensors laid out as ViT-B/16 xCLIP's: per block qkv, proj, fc1, fc2 (weights and biases) and two
    LayerNorms, 12 blocks per tower, two towers; embeddings, final norms and the heads."""
    w, shapes = WIDTH, []
    block = [(3 * w, w), (3 * w,), (w, w), (w,), (4 * w, w), (4 * w,), (w, 4 * w), (w,), (w,), (w,), (w,), (w,)]
    for _ in range(2):
        shapes += block * 12 + [(w,), (w,), (w, w), (197, w)]
    shapes += [(w, w), (w,)] * 40 + [(64 * w, w), (64 * w,)] * 2 + [(w,)] * 20
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]


def _grouped_class(chunk: int) -> type:
    """nclip's gated update, one compiled call per chunk of up to ``chunk`` tensors of one kind."""
    from torchao.optim.subclass_8bit import OptimState8bit

    base = gated_adamw8bit()

    @functools.cache
    def compiled():
        def many(ps, grads, steps, ms, vs, lr, b1, b2, wd, eps, skip, scale):
            for i in range(len(ps)):
                _gated_update(ps[i], grads[i], steps[i], ms[i], vs[i], lr, b1, b2, wd, eps, skip, scale)
        return torch.compile(many, fullgraph=True, dynamic=False)

    class Grouped(base):
        @torch.no_grad()
        def step(self, closure=None):
            skip, scale = self.found_inf, getattr(self, "grad_scale", None)
            with torch._dynamo.utils.disable_cache_limit():
                for group in self.param_groups:
                    kinds: dict[bool, list] = {True: [], False: []}
                    for p in group["params"]:
                        state = self._state_of(p, group)
                        kinds[isinstance(state["exp_avg"], OptimState8bit)].append((p, state))
                    for members in kinds.values():
                        for i in range(0, len(members), chunk):
                            part = members[i:i + chunk]
                            compiled()([p.detach() for p, _ in part], [p.grad for p, _ in part],
                                       [s["step"] for _, s in part],
                                       [_parts(s["exp_avg"], OptimState8bit) for _, s in part],
                                       [_parts(s["exp_avg_sq"], OptimState8bit) for _, s in part],
                                       group["lr"], *group["betas"], group["weight_decay"], group["eps"], skip, scale)

    return Grouped


def _measure(name: str, make, repeats: int) -> None:
    params = _params()
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = make(params)
    opt.found_inf = torch.zeros(())
    t0 = time.perf_counter()
    opt.step()  # compiles
    first = time.perf_counter() - t0
    for _ in range(3):
        opt.step()
    t0 = time.perf_counter()
    for _ in range(repeats):
        opt.step()
    wall = (time.perf_counter() - t0) / repeats * 1e3
    with profile() as prof:
        opt.step()
    graphs = sum(e.cpu_time_total for e in prof.events() if e.name.startswith("## Call CompiledFxGraph")) / 1e3
    calls = sum(1 for e in prof.events() if e.name.startswith("## Call CompiledFxGraph"))
    print(f"{name:34s} {wall:8.2f} ms/step  in compiled graphs {graphs:6.2f} ms ({calls:3d} calls)  "
          f"outside {wall - graphs:6.2f} ms  first step {first:6.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--chunk", type=int, default=0, help="also the grouped variant, N tensors a call")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{len(_params())} tensors, {sum(p.numel() for p in _params()) / 1e6:.2f}M values")
    kw = {"lr": 1e-3, "betas": (0.9, 0.98), "eps": 1e-6, "weight_decay": 0.2}
    _measure("torchao AdamW8bit", lambda ps: _import_adamw8bit()(ps, **kw), args.repeats)
    _measure("nclip gated (per tensor)", lambda ps: gated_adamw8bit()(ps, **kw), args.repeats)
    if args.chunk:
        _measure(f"grouped, chunks of {args.chunk}", lambda ps: _grouped_class(args.chunk)(ps, **kw), args.repeats)
    _measure("torch AdamW fused (fp32 moments)", lambda ps: torch.optim.AdamW(ps, fused=True, **kw), args.repeats)


if __name__ == "__main__":
    main()
