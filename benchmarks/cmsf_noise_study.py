"""CMSF Fig. 3 and Fig. 2 on the built-in digits: linear-probe accuracy on clean labels against the
share of corrupted training labels, for CMSF top-10, CMSF top-all and cross-entropy, over seeds;
and the purity of the top-k neighbours against k random members of the constrained set.

    python benchmarks/cmsf_noise_study.py --out runs/fig3 [--seeds 0 1] [--noise 0 0.25 0.5]

Every run is ``nclip train --preset cmsf-noisy-tiny`` with its overrides, in OUT/runs/<name>, two at a
time with one thread each; a run that has its eval.json is not trained again (re-running the
command resumes the study). Per run: ``linear/digit/top1`` and ``knn/digit/top1`` of the end-of-run
eval (backbone features, the clean labels of the 450 held-out digits) and, for CMSF, the purity of
the neighbours. Written: OUT/study.json (every run) and OUT/study.md (mean over seeds ± half the
range, which for two seeds is the distance of each seed from the mean).

Fig. 2's purity (Sec. 2.2: under noise, the nearest neighbours within the noisy-label constraint
are more often truly of the query's class than arbitrary members of it) is measured on the final
memory bank of each CMSF top-k run: every bank row is a query; its constrained set is the other
rows with the same noisy label (queries with fewer than k of them are left out); purity = share
of the chosen rows whose clean label is the query's, for the k nearest (by cosine of the target
embeddings) and for k drawn at random (seeded).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

METHODS = {  # name -> overrides of cmsf-noisy-tiny (label noise added per run)
    "top-10": ["objective.k=10"],
    "top-all": ["objective.k=null"],
    "xent": ["objective={name: xent}"],
}


def run_name(method: str, noise: float, seed: int) -> str:
    return f"{method}_noise-{noise:g}_seed-{seed}"


def train(out: Path, method: str, noise: float, seed: int) -> Path:
    run = out / "runs" / run_name(method, noise, seed)
    if (run / "eval.json").is_file():
        return run
    if (run / "model").is_dir():  # trained, but the end-of-run eval did not finish: run it
        return evaluate(run)
    overrides = [*METHODS[method], f"objective.label_noise={noise}", f"seed={seed}", "train.threads=1"]
    if method != "xent":
        overrides.append(f"objective.constraint={'noisy_labels' if noise > 0 else 'labels'}")
    cmd = [sys.executable, "-m", "nclip", "train", "--preset", "cmsf-noisy-tiny", "--out", str(run), "--no-progress"]
    cmd += ["--resume", "auto"] if (run / "checkpoints").is_dir() else []
    for o in overrides:
        cmd += ["--set", o]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{run.name} failed: {done.stderr.strip().splitlines()[-1:]}")
    return run


def evaluate(run: Path) -> Path:
    """The trainer's end-of-run eval of a run's final model, written to RUN/eval.json."""
    from nclip.eval.quick import evaluate_run
    from nclip.models.io import load_model

    model, cfg = load_model(run / "model")
    (run / "eval.json").write_text(json.dumps(evaluate_run(model, cfg, "cpu"), indent=2, sort_keys=True))
    return run


def bank_purity(run: Path, k: int, seed: int = 0) -> dict[str, float]:
    """Fig. 2: purity of the top-k and of k random members of the noisy-label constrained set."""
    from nclip.train.checkpoint import list_checkpoints, read_checkpoint

    _, state = read_checkpoint(list_checkpoints(run)[-1])
    obj = state["objective"]
    emb = torch.nn.functional.normalize(obj["bank.bank"].float(), dim=-1)
    noisy, clean = obj["bank.labels"], obj["true_bank.labels"]
    filled = int(obj["bank.filled"])
    emb, noisy, clean = emb[:filled], noisy[:filled], clean[:filled]  # a full bank: the order does not matter
    sim = emb @ emb.T
    same = noisy[:, None] == noisy[None]
    same.fill_diagonal_(False)  # the query itself is not a neighbour here: purity of the others
    match = clean[:, None] == clean[None]
    enough = same.sum(1) >= k  # queries with at least k other members in their constrained set
    sim, same, match = sim[enough], same[enough], match[enough]
    top = sim.masked_fill(~same, float("-inf")).topk(k, dim=1).indices
    rng = torch.Generator().manual_seed(seed)
    rand = torch.multinomial(same.float(), k, replacement=False, generator=rng)
    purity = lambda idx: float(match.gather(1, idx).float().mean())  # noqa: E731
    return {"top_k": purity(top), "random_k": purity(rand)}


def collect(run: Path, method: str) -> dict:
    ev = json.loads((run / "eval.json").read_text())
    flat = ev.get("results", ev)
    row = {"linear": flat["linear/digit/top1"], "knn": flat["knn/digit/top1"]}
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    if "cmsf/purity" in last:
        row["purity_logged"] = last["cmsf/purity"]
    if method == "top-10":
        row.update({f"purity_{k}": v for k, v in bank_purity(run, 10).items()})
    return row


def spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    v = np.asarray(values, dtype=float)
    return f"{v.mean():.3f} ± {(v.max() - v.min()) / 2:.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--noise", type=float, nargs="+", default=[0.0, 0.25, 0.5])
    p.add_argument("--parallel", type=int, default=2)
    args = p.parse_args()
    jobs = [(m, n, s) for n in args.noise for s in args.seeds for m in METHODS]  # noise levels one by one
    with ThreadPoolExecutor(args.parallel) as pool:
        runs = list(pool.map(lambda j: train(args.out, *j), jobs))
    rows = [{"method": m, "noise": n, "seed": s, **collect(r, m)} for (m, n, s), r in zip(jobs, runs)]
    (args.out / "study.json").write_text(json.dumps(rows, indent=2))
    lines = ["| method | label noise | linear top-1 | k-NN top-1 | purity top-10 (logged) "
             "| purity top-10 / random-10 (bank) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for m in METHODS:
        for n in args.noise:
            sel = [r for r in rows if r["method"] == m and r["noise"] == n]
            logged = spread([r["purity_logged"] for r in sel]) if "purity_logged" in sel[0] else "–"
            bank = (f"{spread([r['purity_top_k'] for r in sel])} / {spread([r['purity_random_k'] for r in sel])}"
                    if "purity_top_k" in sel[0] else "–")
            lines.append(f"| {m} | {n:g} | {spread([r['linear'] for r in sel])} | {spread([r['knn'] for r in sel])} "
                         f"| {logged} | {bank} |")
    table = "\n".join(lines) + f"\n\nmean over seeds {args.seeds} ± half the range\n"
    (args.out / "study.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
