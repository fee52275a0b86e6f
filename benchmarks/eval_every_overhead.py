"""What evaluation while training (``train.eval_every``, nclip.train.periodic_eval) costs a run.

    python benchmarks/eval_every_overhead.py [--preset tiny] [--steps 200] [--set KEY=VALUE ...]

Trains ``--preset`` for ``--steps`` steps at the default ``train.eval_every`` and
``train.eval_samples`` (or ``--set`` ones) and prints the share of the run's wall time its
evaluations took (the sum of the rows' ``eval_s`` over the run's wall time, both measured in the
same run, so a loaded machine slows both alike), and that share for the preset's own length:
``evaluations(steps) x mean eval_s / (steps x training s/step + evaluations x mean eval_s)``.
The issue's target: at most 5 % of a ``tiny`` run at the default interval. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=200, help="steps trained here (the share is projected)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()

    from nclip.config import resolve
    from nclip.train.loop import train

    full = resolve(args.preset, args.overrides)
    cfg = resolve(args.preset, [*args.overrides, f"train.steps={args.steps}"])
    with tempfile.TemporaryDirectory(prefix="nclip-bench-") as tmp:
        start = time.perf_counter()
        train(cfg, Path(tmp) / "run", progress=False, evaluate=False)
        wall = time.perf_counter() - start
        rows = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_s"] for r in rows if "eval_s" in r]
    if not evals:
        print(f"no evaluation in {args.steps} steps (train.eval_every {cfg.train.eval_every})")
        return
    mean_eval, step_s = sum(evals) / len(evals), (wall - sum(evals)) / args.steps
    n_full = full.train.steps // full.train.eval_every
    projected = n_full * mean_eval / (full.train.steps * step_s + n_full * mean_eval)
    print(f"{args.preset}: {args.steps} steps in {wall:.0f} s, {len(evals)} evaluation(s) of "
          f"{cfg.train.eval_samples} images, {mean_eval:.1f} s each, {step_s:.2f} s per training step")
    print(f"evaluation share of this run: {sum(evals) / wall:.1%}; of a {full.train.steps}-step run "
          f"(train.eval_every {full.train.eval_every}, {n_full} evaluations): {projected:.1%}")


if __name__ == "__main__":
    main()
