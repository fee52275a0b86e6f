"""``nclip bench``'s command: run the bench, print its table, write its JSON."""

from __future__ import annotations

import sys


def run_bench_command(args) -> int:
    from nclip.bench.runner import run_bench, write_json

    doc = run_bench(args.preset, args.overrides, quick=args.quick, compare=args.compare,
                    log=lambda msg: print(msg, file=sys.stderr, flush=True), budget_s=args.budget_s,
                    memory_gib=args.memory_gib)
    print(f"device: {doc['device']}; preset {args.preset} {' '.join(args.overrides)}".rstrip())
    print(doc["table"])
    if args.json:
        write_json(doc, args.json)
    return 0
