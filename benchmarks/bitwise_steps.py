"""Bitwise record of short training runs: every preset on micro sizes, every registered objective on
micro, and the trainer options of the host-sync test; the first 20 steps' logged metrics and a digest of
the final weights. Run it before and after a refactor and compare the two JSON files
(`--compare OLD NEW`): equal means training is bitwise the same (issue 34).

    PYTHONPATH=src python benchmarks/bitwise_steps.py --out before.json
    PYTHONPATH=src python benchmarks/bitwise_steps.py --compare before.json after.json

benchmarks/results/bitwise_steps_6919fcc.json is the record of main before issue 34 (commit 6919fcc).
The cases' sizes are the tests' (tests/conftest.py: micro_sizes, micro_objective; host_syncs.OPTIONS), and a
record compares only with one made at the same sizes: since every head and CMSF's bank became micro-sized
(after 6919fcc), the cases with a ProtoCLIP, CMSF or SupCon head or a bank no longer match that record's.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

STEPS = ["train.steps=20", "train.log_every=1", "train.checkpoint_every=1000", "train.batch_size=8",
         "data.train_length=64", "train.eval_every=0", "train.warmup_steps=2"]
# the paper-scale ProtoCLIP preset's 200k-pair episodes and 20k clusters, at the tests' micro_objective sizes
SMALL = ["objective.episode_size=32", "objective.clusters=4"]
# the paper-scale presets read data that is not on this machine: the built-in data of their kind instead
PRESET_EXTRA = {"cmsf-rn50-in1k": ["data.source=digits", "data.folder=null"],
                "protoclip-rn50-cc": ["data.source=synthetic", "data.image_size=32", *SMALL]}


def cases() -> dict[str, tuple[str, list[str]]]:
    from nclip.config_files import preset_names
    from nclip.objectives import REGISTRY

    from conftest import micro_objective, micro_sizes
    from host_syncs import OPTIONS

    out = {}
    for name in preset_names():
        out[f"preset:{name}"] = (name, [*micro_sizes(), *PRESET_EXTRA.get(name, [])])
    for name in REGISTRY:
        out[f"objective:{name}"] = ("micro", [*micro_sizes(), *micro_objective(name)])
    for name, extra in OPTIONS.items():
        out[f"option:{name}"] = ("micro", [*micro_sizes(), *extra])
    return out


def weights_digest(run: Path) -> list[str]:
    """The sorted sha256 of every tensor of the saved model: independent of the state dict's key names."""
    from safetensors.torch import load_file

    digests = []
    for path in sorted((run / "model").glob("*.safetensors")):
        for tensor in load_file(path).values():
            t = tensor.contiguous().reshape(-1)
            digest = hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()[:16] if t.numel() else "empty"
            digests.append(f"{tuple(tensor.shape)}:{t.dtype}:{digest}")
    return sorted(digests)


def record(name: str, preset: str, overrides: list[str]) -> dict:
    from nclip.config import resolve
    from nclip.train.logbook import WALL_CLOCK
    from nclip.train.loop import train

    torch.set_num_threads(1)
    cfg = resolve(preset, [*overrides, *STEPS])
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        run = Path(tmp) / "run"
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            train(cfg, run, progress=False, evaluate=False)
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        for r in rows:
            for key in WALL_CLOCK:
                r.pop(key, None)
        return {"rows": rows, "weights": weights_digest(run)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--compare", nargs=2)
    args = ap.parse_args()
    if args.compare:
        old, new = (json.loads(Path(p).read_text()) for p in args.compare)
        bad = [k for k in old if old[k] != new.get(k)]
        for k in bad:
            print(f"DIFFERS {k}: {str(old[k])[:200]} / {str(new.get(k))[:200]}")
        print(f"{len(old) - len(bad)} of {len(old)} cases bitwise the same")
        sys.exit(1 if bad else 0)
    results = {}
    for name, (preset, overrides) in cases().items():
        if args.only and not any(o in name for o in args.only):
            continue
        try:
            results[name] = record(name, preset, overrides)
            print(name, "ok", len(results[name]["rows"]), flush=True)
        except Exception as e:  # a case that cannot run on micro sizes is recorded as such
            results[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            print(name, "ERROR", results[name]["error"], flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
