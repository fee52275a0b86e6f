"""The ``nclip eval`` subcommand (registered by :mod:`nclip.cli`).

    nclip eval --checkpoint RUN_DIR --out DIR [--tasks zeroshot,linear,...] [--dataset SPEC ... | --suite FILE.yaml]
               [--head SCORE] [--nclip-score symmetric|image_to_text]
               [--features backbone|HEAD] [--baseline RUN_DIR] [--hierarchy FILE|builtin]
               [--cache-dir DIR | --no-cache]
               [--classnames FILE] [--templates FILE|imagenet80|simple] [--topk 3,5,10,20] [--no-report]
               [--segment-threshold T] [--voc-classnames voc|groupvit]
               [--tsne-iters N]
    nclip eval compare EVAL_A EVAL_B ... [--out FILE.md]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import get_args

from nclip import plugin_consent
from nclip.errors import NclipError
from nclip.overwrite import EVAL, check_output_folder


def add_eval_parser(sub) -> argparse.ArgumentParser:
    """The ``nclip eval`` parser; its choices and help are made from the tables of dataset kinds
    (:mod:`nclip.dataset_specs`), tasks and SGD recipes (:mod:`nclip.eval.settings`)."""
    from nclip.dataset_specs import CLASSNAMES, TEMPLATES, kinds_taking, spec_help
    from nclip.defaults import DEVICES, NCLIP_SCORES
    from nclip.eval.settings import TASK_TABLE, TASKS, EvalSettings, Probe, VocClassnames
    from nclip.eval.sgd_recipes import SGD_RECIPES, recipes_help

    d = EvalSettings()
    default_tasks = [TASK_TABLE[t].title for t in TASKS]
    p = sub.add_parser("eval", help="evaluate a checkpoint with the papers' protocols (results.json + report.html)",
                       description=f"Evaluate a checkpoint: {', '.join(default_tasks[:-1])} and {default_tasks[-1]}. "
                                   "`nclip eval compare A B ...` tabulates evaluations.")
    p.add_argument("--checkpoint", type=Path, help="run directory, model directory or RUN/checkpoints/step_N")
    p.add_argument("--out", type=Path, help="output directory for results.json and report.html (one that holds "
                   "an evaluation is refused unless --force)")
    p.add_argument("--force", action="store_true", help="write over the evaluation an --out holds")
    plugin_consent.add_flag(p)
    optional = ", ".join(f"{task.name} ({task.title})" for task in TASK_TABLE.values() if task.optional)
    p.add_argument("--tasks", help=f"comma-separated subset of: {','.join(TASKS)} (default: all); also {optional}")
    p.add_argument("--dataset", dest="datasets", action="append", metavar="SPEC",
                   help=f"{spec_help()} (repeatable; default: {' and '.join(d.datasets)})")
    p.add_argument("--suite", type=Path, metavar="FILE.yaml",
                   help="a benchmark suite: datasets with their tasks (and prompts) in one YAML file; one "
                        "results.json and report with a table across the datasets and their mean "
                        "(docs/eval-data.md); instead of --dataset/--tasks/--classnames/--templates")
    # the scores and heads are registered kinds (a plugin adds its own): checked against the checkpoint
    p.add_argument("--head", metavar="SCORE",
                   help="zero-shot score, a registered one: clip cosine, nclip −L_CE, yclip S, or a plugin's "
                        "(default: the objective's)")
    p.add_argument("--nclip-score", choices=NCLIP_SCORES,
                   help="nCLIP's −L_CE: symmetrised as Eq. 2 (default) or image→text only")
    p.add_argument("--features", metavar="backbone|HEAD",
                   help="image features of the linear, k-NN, clustering and realm probes: backbone or a head "
                        "of the checkpoint that offers them, clip | nclip | proto or a plugin's (default: the "
                        "objective's paper protocol, ProtoCLIP: clip = z, App. B; the others: backbone)")
    p.add_argument("--probe", choices=get_args(Probe), default=d.probe,
                   help="linear probe: lbfgs (CLIP App. A.3, L2 chosen on a validation split; default) or sgd "
                        "(the papers' SGD recipes, see --probe-recipe)")
    p.add_argument("--probe-recipe", choices=tuple(SGD_RECIPES),
                   help=f"SGD probe recipe: {recipes_help()}; default: the objective's paper")
    p.add_argument("--probe-epochs", type=int, help="SGD probe epochs (default: the recipe's)")
    p.add_argument("--classnames", metavar="FILE",
                   help=f"class names of {_kinds(kinds_taking(CLASSNAMES))} data: one per line in sorted folder "
                        "(label, class-index) order, a JSON map folder -> name, or a JSON class-index file "
                        "index -> name | [folder, name] (default: the folder names; wds: its classnames.txt)")
    p.add_argument("--templates", metavar="FILE|imagenet80|simple",
                   help=f"prompt templates of {_kinds(kinds_taking(TEMPLATES))} data: a file, one per "
                        "line with {} for the class name, imagenet80 (CLIP's 80 ImageNet prompts) or simple "
                        "(GroupViT's 'a photo of a {}.'; default: wds: its zeroshot_classification_templates.txt, "
                        "masks: imagenet80)")
    p.add_argument("--topk", default=",".join(map(str, d.multilabel_topk)),
                   help="k of multi-label precision/recall/F1@k (xCLIP Tab. 3)")
    p.add_argument("--image-key", help="image-path column of a captions: CSV (default: the run's "
                   "data.csv_image_key if the header has it, else image/image_path/filepath/file/path)")
    p.add_argument("--caption-key", help="caption column of a captions: CSV (default: the run's "
                   "data.csv_caption_key if the header has it, else the caption* columns)")
    p.add_argument("--baseline", metavar="RUN_DIR", help="run or eval directory for relative realm accuracy")
    p.add_argument("--arch", metavar="NAME", help="open_clip config (e.g. ViT-B-32, RN50) of an open_clip or OpenAI "
                   "state-dict file given as --checkpoint or --baseline (default: read from its tensors as "
                   "OpenAI's; docs/transfer.md)")
    p.add_argument("--hierarchy", metavar="FILE|builtin",
                   help="realm labels for the realms task from each dataset's class labels and a class hierarchy: "
                        "a JSON or TSV file (realm = the child of the root on a class's path), or builtin "
                        "(synthetic shapes: polygon / curved shape / symbol; digits: round / straight / mixed)")
    p.add_argument("--cache-dir", type=Path, help="feature cache (default: OUT/../.nclip-cache)")
    p.add_argument("--no-cache", action="store_true", help="extract features afresh and store nothing")
    p.add_argument("--no-report", action="store_true", help="write results.json only")
    p.add_argument("--tsne-iters", type=int, default=d.tsne_iters,
                   help="t-SNE iterations of the report's figure (default: the xCLIP paper's 5,000, App. G)")
    p.add_argument("--samples", type=int, default=d.test_samples, help="synthetic test scenes")
    p.add_argument("--train-samples", type=int, default=d.train_samples, help="synthetic scenes to train probes on")
    p.add_argument("--sts-pairs", type=int, default=d.sts_pairs, help="built-in STS sentence pairs")
    p.add_argument("--mask-samples", type=int, default=d.mask_samples, help="scenes for mask probing")
    p.add_argument("--segment-threshold", type=float, default=d.segment_threshold,
                   help="zero-shot segmentation: a group whose best class score is below min(this, the image's "
                        "best group score) is background, GroupViT's rule (default: its 0.95; 0: no background)")
    p.add_argument("--voc-classnames", choices=get_args(VocClassnames), default=d.voc_classnames,
                   help="zero-shot segmentation of masks: data: VOC's names of its 20 classes, or GroupViT's "
                        "('table', 'plant', 'monitor' for 'dining table', 'potted plant', 'tv monitor')")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the evaluation data and the probes")
    p.add_argument("--device", choices=DEVICES, default=d.device)
    p.add_argument("--quiet", action="store_true", help="no progress messages")

    sub2 = p.add_subparsers(dest="eval_command", metavar="compare")
    c = sub2.add_parser("compare", help="side-by-side markdown table of several evaluations")
    c.add_argument("runs", nargs="+", help="eval directories, results.json files or run directories (eval.json)")
    c.add_argument("--out", dest="compare_out", type=Path, help="write the markdown here (default: stdout)")
    return p


def _kinds(names: tuple[str, ...]) -> str:
    return "/".join(f"{name}:" for name in names)


def run_eval_command(args) -> int:
    if getattr(args, "eval_command", None) == "compare":
        from nclip.eval.compare import markdown

        text = markdown(args.runs, warn=lambda line: print(f"nclip: warning: {line}", file=sys.stderr))
        if args.compare_out:
            args.compare_out.parent.mkdir(parents=True, exist_ok=True)
            args.compare_out.write_text(text)
            print(args.compare_out)
        else:
            print(text, end="")
        return 0
    if args.checkpoint is None or args.out is None:
        raise NclipError("eval: --checkpoint and --out are required (or use `nclip eval compare`)")

    if args.suite is not None:
        given = [o for o, v in (("--dataset", args.datasets), ("--tasks", args.tasks),
                                ("--classnames", args.classnames), ("--templates", args.templates)) if v]
        if given:
            raise NclipError(f"eval: --suite names each dataset with its tasks and prompts; drop {', '.join(given)}")
    from nclip.eval.settings import TASKS, EvalSettings

    tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip()) if args.tasks is not None else TASKS
    settings = EvalSettings().updated(
        _option, tasks=tasks, datasets=tuple(args.datasets or EvalSettings().datasets), head=args.head,
        features=args.features, probe=args.probe, probe_recipe=args.probe_recipe, probe_epochs=args.probe_epochs,
        classnames=args.classnames, templates=args.templates,
        multilabel_topk=_ints(args.topk, "--topk"), baseline=args.baseline, arch=args.arch, hierarchy=args.hierarchy,
        image_key=args.image_key, caption_key=args.caption_key,
        test_samples=args.samples, train_samples=args.train_samples,
        sts_pairs=args.sts_pairs, mask_samples=args.mask_samples,
        segment_threshold=args.segment_threshold, voc_classnames=args.voc_classnames, batch_size=args.batch_size,
        seed=args.seed,
        tsne_iters=args.tsne_iters,
        device=args.device, **({"nclip_score": args.nclip_score} if args.nclip_score else {}))
    if args.suite is not None:
        from nclip.eval.suite import load_suite

        load_suite(args.suite)  # checked here too: a mistake in the file answers before torch is imported
    check_eval_out(args.out, args.force)  # before torch is imported, and again under the lock
    from nclip.eval.runner import run_eval  # after the settings: their mistakes answer before torch is imported
    from nclip.runlock import DirLock

    with DirLock(args.out, "nclip eval"):  # one writer (docs/runs.md)
        check_eval_out(args.out, args.force)
        doc = _evaluate(args, settings, run_eval)
    print(summary(doc, args.out, report=not args.no_report))
    return 0


EVAL_OUTPUTS = EVAL.markers  # results.json, report.html


def check_eval_out(out: Path, force: bool) -> None:
    """An --out that holds an evaluation is refused unless ``force``: a second `nclip eval` with other
    settings would replace the first one's results without a word; ``force`` replaces an evaluation
    only, never a run's or another command's files (:func:`nclip.overwrite.check_output_folder`)."""
    if force:
        check_output_folder(out, "--out", EVAL)
    held = [name for name in EVAL_OUTPUTS if (out / name).exists()]
    if held and not force:
        raise NclipError(f"eval: --out {out} already holds an evaluation ({held[0]}); choose another --out, "
                         "or pass --force to write over it")


def _evaluate(args, settings, run_eval) -> dict:
    cache = None if args.no_cache else (args.cache_dir if args.cache_dir else "default")
    log = None if args.quiet else (lambda msg: print(f"eval: {msg}", file=sys.stderr, flush=True))
    if args.suite is not None:
        from nclip.eval.suite import run_suite

        doc = run_suite(args.checkpoint, args.out, args.suite, settings=settings, cache_dir=cache,
                        report=not args.no_report, log=log)
    else:
        doc = run_eval(args.checkpoint, args.out, settings=settings, cache_dir=cache, report=not args.no_report,
                       log=log)
    return doc


# the settings fields not named as their option
_OPTIONS = {"test_samples": "--samples", "datasets": "--dataset", "multilabel_topk": "--topk"}


def _ints(text: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise NclipError(f"eval: {option}: expected comma-separated integers, got {text!r}") from None


def _option(location: str) -> str:
    """The option that sets a settings field (``train_samples`` → ``--train-samples``), for errors;
    "" for a check across fields."""
    name = location.split(".")[0]
    return _OPTIONS.get(name, "--" + name.replace("_", "-")) if name else ""


_SUMMARY = ("/top1", "/hardneg_top1", "/mean_recall", "/mAP", "/mean_top1", "/spearman", "/jaccard", "/ari",
            "/miou", "/macc")


def _suite_rows(section: dict) -> list[tuple[str, str]]:
    """The suite's headline cells, each labelled with its dataset and metric, then their mean: the
    report's suite table (:func:`nclip.eval.suite_table.table_rows`), one line a cell, so that the
    console shows exactly the cells the mean is computed from."""
    from nclip.eval.suite_table import table_rows

    head, (row, *_) = table_rows([section])
    used, total = section["mean"]["cells"]
    cells = [(f"suite: {h}", v) for h, v in zip(head, row) if not h.startswith("Mean")]
    mean = row[len(cells)].split(" (")[0]  # the report's Mean cell, less its "(used/total)"
    return cells + [(f"suite mean of {section['name']}", f"{mean} (of the {used} cells above"
                     + (f"; {total - used} without a value" if used < total else "") + ")")]


def summary(doc: dict, out: Path, report: bool = True) -> str:
    from nclip.eval.report import fmt
    from nclip.eval.settings import TASKS

    r = doc["results"]
    keys = sorted((k for k in r if k.endswith(_SUMMARY)),
                  key=lambda k: (TASKS.index(k.split("/")[0]) if k.split("/")[0] in TASKS else 99, k))
    rows = [(k, fmt(k.rsplit("/", 1)[1], r[k])) for k in keys]
    suite = _suite_rows(doc["suite"]) if doc.get("suite") else []
    width = max([len(k) for k, _ in rows + suite] + [10])
    c = doc["cache"]
    lines = [f"{k:<{width}}  {v}" for k, v in rows + suite]
    lines += [f"{task:<{width}}  skipped: {reason}" for task, reason in doc.get("skipped", {}).items()]
    sts = "; STS: Spearman x 100" if any(k.endswith("/spearman") for k in keys) else ""
    lines.append(f"(percent{sts})")
    lines.append(f"{'results':<{width}}  {Path(out) / 'results.json'}")
    if report:
        lines.append(f"{'report':<{width}}  {Path(out) / 'report.html'}")
    lines.append(f"{'time':<{width}}  {doc['timing']['total_s']:.1f} s (feature cache: {len(c['hits'])} hits, "
                 f"{len(c['misses'])} misses)")
    return "\n".join(lines)
