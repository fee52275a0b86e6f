"""On a GPU: train every registered objective (and the step options of tests/train/test_host_syncs.py)
a few steps with ``torch.cuda.set_sync_debug_mode("error")`` around the steps that log nothing, so
that any host sync in them raises (issue 32 item 8). The CPU proof is the profiler test; this is the
same check where the device really waits.

    PYTHONPATH=src python benchmarks/gpu_sync_check.py --json sync.json        # every case, ~2 min on an H100

Each case prints ``ok`` or the first sync's error (and where it was raised); the exit status is the
number of cases that synced. On a machine without CUDA it says so and exits 0 (nothing to check).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # tests/host_syncs.py: the CPU test's cases and quiet steps (no pytest)

STEPS = ["train.steps=5", "train.log_every=4", "train.checkpoint_every=100", "train.batch_size=8",
         "data.train_length=64", "train.eval_every=0", "train.memory_check=false"]


def _cases() -> dict[str, list[str]]:
    from nclip.objectives import REGISTRY

    from host_syncs import OPTIONS  # the CPU test's options: the same cases on both devices

    cases = {name: [f"objective.name={name}"] for name in REGISTRY}
    cases.update(OPTIONS)
    return cases


def _check(overrides: list[str]) -> str:
    """'ok', or the first sync's message and the nclip frame that made it."""
    import nclip.train.loop as loop_mod
    from nclip.config import resolve

    from host_syncs import quiet_steps

    real_step = loop_mod._step

    def step(run, index, batch):
        if not quiet_steps(index, run.cfg):
            return real_step(run, index, batch)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real_step(run, index, batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    loop_mod._step = step
    try:
        cfg = resolve("micro", STEPS + overrides)
        with tempfile.TemporaryDirectory() as tmp:
            loop_mod.train(cfg, Path(tmp) / "run", progress=False, evaluate=False)
        return "ok"
    except RuntimeError as e:
        frames = [f for f in traceback.extract_tb(e.__traceback__) if "/nclip/" in f.filename]
        where = f" at {frames[-1].filename.split('src/')[-1]}:{frames[-1].lineno}" if frames else ""
        return f"{str(e).splitlines()[0]}{where}"
    finally:
        loop_mod._step = real_step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write {case: result} here")
    parser.add_argument("--only", nargs="*", help="these cases only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check (the CPU proof is tests/train/test_host_syncs.py)")
        return 0
    results = {}
    for case, overrides in _cases().items():
        if args.only and case not in args.only:
            continue
        results[case] = _check(overrides)
        print(f"{case:28s} {results[case]}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "cases": results}, indent=2))
    return sum(r != "ok" for r in results.values())


if __name__ == "__main__":
    raise SystemExit(main())
