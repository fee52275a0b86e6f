"""Do NegCLIP's swap negatives help CLIP on the scenes? CLIP with and without ``data.hard_negatives=swap``.

NegCLIP (Yuksekgonul et al. 2023) adds, for every image, captions with their words or attributes swapped
as extra text candidates of its InfoNCE row, and reports higher accuracy on ARO's order and relation
tests at nearly equal retrieval. The same on the built-in scenes: the ``clip-tiny`` preset (1,000 steps
of 128 pairs) trained without and with swap negatives, then measured on

- two ``hardneg:`` files of held-out scenes (the test split, written here): ``swaps.jsonl``, each
  scene's caption against one swap of it (what the swap runs train against, on other images), and
  ``siblings.jsonl``, each scene's captions against the first captions of the other scenes of its
  hard-negative group, which differ from it only in their shapes (what neither run trains on as a
  text candidate; ``clip-tiny`` keeps such groups in one batch as in-batch negatives);
- the run's own end-of-training evaluation on the built-in held-out scenes (zero-shot shape, a
  linear probe on shape, image → text R@1): what the negatives might cost.

    python benchmarks/swap_negatives_study.py --out runs/swap-study --seeds 0 1

runs ``nclip sweep`` (two runs at once on two cores), evaluates every run on both files, and writes
OUT/table.md (the measured table and the verdict rows, by the rule of docs/reproduction.md) and
OUT/results.json. Runs and evaluations that exist are not repeated (re-run the command to continue).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HELD_OUT = 500  # test-split scenes in each file (125 hard-negative groups of 4)
SWAP_SEED = 1234  # the held-out files' swap draws: not any training run's seed
GRID = """# written by benchmarks/swap_negatives_study.py
grid:
  seed: [{seeds}]
settings:
  clip: {{}}
  clip-swap: {{data.hard_negatives: swap}}
"""
SCORES = [  # (column, file in the run's folder, key)
    ("swap acc", "hardneg-swaps/results.json", "retrieval/swaps/hardneg_top1"),
    ("sibling acc", "hardneg-siblings/results.json", "retrieval/siblings/hardneg_top1"),
    ("ZS shape", "eval.json", "zeroshot/shape/top1"),
    ("LN shape", "probe.json", "linear/top1"),
    ("I→T R@1", "eval.json", "retrieval/i2t@1"),
]
# what each score is asked: NegCLIP's claims (higher on the swap test, level on the others) and this
# project's prediction for the sibling test, which NegCLIP does not report
CLAIMS = {"swap acc": ("swap negatives help on swapped captions (NegCLIP)", ">"),
          "sibling acc": ("swap negatives help on sibling captions (this project's prediction)", ">"),
          "ZS shape": ("no cost on the standard scores (NegCLIP)", "="),
          "LN shape": ("no cost on the standard scores (NegCLIP)", "="),
          "I→T R@1": ("no cost on the standard scores (NegCLIP)", "=")}


def write_sets(out: Path) -> tuple[Path, Path]:
    """The two held-out hard negative files (module docstring), sharing one folder of images."""
    from PIL import Image

    from nclip.config import resolve
    from nclip.data.hard_negatives import swap_caption
    from nclip.data.synthetic import SyntheticScenes

    swaps, siblings = out / "swaps.jsonl", out / "siblings.jsonl"
    if swaps.exists() and siblings.exists():
        return swaps, siblings
    d = resolve("clip-tiny").data
    scenes = SyntheticScenes("test", HELD_OUT, seed=0, image_size=d.image_size, max_objects=d.max_objects,
                             hard_negative_group=d.hard_negative_group)
    (out / "images").mkdir(parents=True, exist_ok=True)
    samples = [scenes[i] for i in range(HELD_OUT)]
    swap_rows, sibling_rows = [], []
    group = scenes.hard_negative_group
    for i, s in enumerate(samples):
        image = f"images/{i:05d}.png"
        Image.fromarray(s.image).save(out / image)
        if (swapped := swap_caption(s.captions[0], SWAP_SEED, i)) is not None:
            swap_rows.append({"image": image, "caption": s.captions[0], "negatives": [swapped]})
        shapes = sorted(s.mask_classes.tolist())
        others = samples[i - i % group:i - i % group + group]
        negatives = [o.captions[0] for o in others if sorted(o.mask_classes.tolist()) != shapes]
        if negatives:
            sibling_rows.append({"image": image, "caption": list(s.captions), "negatives": negatives})
    for path, rows in ((swaps, swap_rows), (siblings, sibling_rows)):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return swaps, siblings


def nclip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "nclip", *args], check=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=1000, help="train.steps of every run (clip-tiny's 1,000)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    swaps, siblings = write_sets(args.out / "held-out")
    grid = args.out / "grid.yaml"
    grid.write_text(GRID.format(seeds=", ".join(map(str, args.seeds))))
    sweep = args.out / "sweep"
    if not (sweep / "sweep.json").exists() or any(not (r / "eval.json").exists() for r in _runs(sweep)):
        nclip("sweep", "--preset", "clip-tiny", "--grid-file", str(grid), "--set", f"train.steps={args.steps}",
              "--set", "train.eval_every=0", "--out", str(sweep), "--parallel", "2",
              *(["--resume"] if sweep.exists() else []))
    for run in _runs(sweep):
        for name, path in (("swaps", swaps), ("siblings", siblings)):
            if not (run / f"hardneg-{name}" / "results.json").exists():
                nclip("eval", "--checkpoint", str(run), "--dataset", f"hardneg:{path}", "--tasks", "retrieval",
                      "--out", str(run / f"hardneg-{name}"), "--quiet")
    results = {run.name: {column: 100 * _score(run / file, key) for column, file, key in SCORES}
               for run in _runs(sweep)}
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    table = markdown(results, args.seeds)
    (args.out / "table.md").write_text(table)
    print(table, end="")


def _score(path: Path, key: str) -> float:
    """A score of a run's eval.json / probe.json, or of an ``nclip eval`` results.json (under "results")."""
    data = json.loads(path.read_text())
    return data["results"][key] if "results" in data else data[key]


def _runs(sweep: Path) -> list[Path]:
    return sorted(p for p in (sweep / "runs").glob("*") if p.is_dir()) if (sweep / "runs").is_dir() else []


def markdown(results: dict, seeds: list[int]) -> str:
    """The measured table (mean ± half the seeds' range) and one verdict row per score (``CLAIMS``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from doc_verdicts import compare, level, parse_figure

    names = {"clip": "CLIP", "clip-swap": "CLIP + swap negatives"}
    cells = {}
    lines = ["<!-- table: swap negatives -->", "| run | seeds | " + " | ".join(c for c, _, _ in SCORES) + " |",
             "|:--|:--|" + "--:|" * len(SCORES)]
    for setting, label in names.items():
        values = [[results[f"{setting}_seed-{s}"][c] for s in seeds] for c, _, _ in SCORES]
        cells[setting] = [_cell(v) for v in values]
        lines.append(f"| {label} | {', '.join(map(str, seeds))} | " + " | ".join(cells[setting]) + " |")
    lines += ["", "| claim | score | table | order tested | verdict |", "|:--|:--|:--|:--|:--|"]
    for i, (column, _, _) in enumerate(SCORES):
        claim, order = CLAIMS[column]
        swap, plain = parse_figure(cells["clip-swap"][i]), parse_figure(cells["clip"][i])
        verdict = compare(swap, plain, True) if order == ">" else level(swap, plain)
        lines.append(f"| {claim} | {column} | swap negatives | CLIP + swap negatives {order} CLIP | {verdict} |")
    return "\n".join(lines) + "\n"


def _cell(values: list[float]) -> str:
    mean, half = sum(values) / len(values), (max(values) - min(values)) / 2
    return f"{mean:.2f} (both seeds)" if round(half, 2) == 0 else f"{mean:.2f} ± {half:.2f}"


if __name__ == "__main__":
    main()
