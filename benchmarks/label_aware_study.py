"""OmniBenchmark Tab. 2 on built-in data: SupCon vs PaCo vs ReCo, linear and realm-wise probes.

The paper pre-trains each objective on ImageNet-1k labels and probes the frozen backbone on
realms whose concepts ImageNet does not contain. The same on the digits, CPU-sized: one realm of
the built-in digits hierarchy (round 0 6 8 9 / straight 1 4 7 / mixed 2 3 5, made up) is held out
of pre-training through ``data.exclude``; every objective trains with the ``supcon-tiny`` preset
on the other realms' labels, and ``nclip eval`` then probes

- linearly on all ten digits (the pre-training label kind, held-out classes included), and
- realm-wise (``--hierarchy builtin``): one linear classifier per realm, the held-out realm's
  classes never seen as labels in pre-training.

    python benchmarks/label_aware_study.py --out runs/tab2 --seeds 0 1

prints a Markdown table (mean over seeds, ± half the range) and writes OUT/table.md and
OUT/results.json. Runs whose eval exists are not repeated (re-run the command to continue).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

OBJECTIVES = {"supcon": [], "paco": ["objective.name=paco"], "reco": ["objective.name=reco"],
              "reco-paco": ["objective.name=reco", "objective.base=paco"]}


def held_out_exclusions(seed: int, realm: str, path: Path) -> int:
    """Write the ``digits:train:i`` identifiers of the training digits in ``realm`` to ``path``."""
    from nclip.data.digits import DIGIT_NAMES, DigitsPairs
    from nclip.data.hierarchies import builtin_hierarchy

    realms = builtin_hierarchy("digits").realms(list(DIGIT_NAMES))
    if realm not in set(realms.values()):
        sys.exit(f"unknown realm {realm!r}: the digits' realms are {sorted(set(realms.values()))}")
    train = DigitsPairs("train", seed=seed)
    ids = [f"digits:train:{i}" for i, t in enumerate(train.targets) if realms[DIGIT_NAMES[int(t)]] == realm]
    path.write_text("\n".join(ids) + "\n")
    return len(ids)


def nclip(*args: str) -> None:
    cmd = [sys.executable, "-m", "nclip", *args]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def run_one(out: Path, name: str, seed: int, excl: Path, steps: int | None) -> dict:
    rd = out / "runs" / f"{name}-s{seed}"
    ev = rd / "eval-study"
    if not (ev / "results.json").is_file():
        sets = [f"seed={seed}", f"data.exclude={excl}", *OBJECTIVES[name]]
        sets += [f"train.steps={steps}"] if steps else []
        if not (rd / "model").is_dir():
            nclip("train", "--preset", "supcon-tiny", "--out", str(rd), "--no-progress", "--resume", "auto",
                  *[a for s in sets for a in ("--set", s)])
        nclip("eval", "--checkpoint", str(rd), "--out", str(ev), "--dataset", "digits",
              "--tasks", "linear,realms", "--hierarchy", "builtin")
    return json.loads((ev / "results.json").read_text())["results"]


def summary(values: list[float]) -> str:
    mean = statistics.fmean(values)
    half = (max(values) - min(values)) / 2
    return f"{100 * mean:.1f} ± {100 * half:.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--objectives", nargs="+", default=list(OBJECTIVES), choices=list(OBJECTIVES))
    p.add_argument("--held-out", default="mixed", help="realm of the digits hierarchy held out of pre-training")
    p.add_argument("--steps", type=int, help="train.steps (default: the preset's 600)")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    excl = {}
    for s in a.seeds:  # one exclusion list per seed (the seed fixes the digits' train split)
        excl[s] = a.out / f"exclude-{a.held_out}-s{s}.txt"
        n = held_out_exclusions(s, a.held_out, excl[s])
        print(f"seed {s}: {n} training digits of realm {a.held_out!r} held out", flush=True)
    results = {name: [run_one(a.out, name, s, excl[s], a.steps) for s in a.seeds] for name in a.objectives}

    realm_keys = sorted({k for runs in results.values() for m in runs for k in m
                         if k.startswith("realms/digits-") and k.endswith("/top1")})
    head = ["objective", "linear, 10 digits"] + [
        k.removeprefix("realms/digits-").removesuffix("/top1") + (" (held out)" if a.held_out in k else "")
        for k in realm_keys] + ["realm mean"]
    lines = ["| " + " | ".join(head) + " |", "|:--|" + "--:|" * (len(head) - 1)]
    for name, runs in results.items():
        cells = [summary([m["linear/digits-digit/top1"] for m in runs])]
        cells += [summary([m[k] for m in runs]) for k in realm_keys]
        cells += [summary([m["realms/digits/mean_top1"] for m in runs])]
        lines.append("| " + " | ".join([name, *cells]) + " |")
    table = "\n".join(lines)
    note = (f"Top-1 (%) on the held-out digits test split, mean over seeds {a.seeds} ± half the range; "
            f"realm {a.held_out!r} excluded from pre-training.")
    (a.out / "table.md").write_text(table + "\n\n" + note + "\n")
    (a.out / "results.json").write_text(json.dumps(results, indent=1))
    print(table + "\n\n" + note)


if __name__ == "__main__":
    main()
