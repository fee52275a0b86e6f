"""``nclip finetune``: the learning-rate sweep, the test number, results.json and report.html.

    nclip finetune --checkpoint RUN --dataset digits|synthetic|folder:DIR --out DIR
                   [--fraction 0.01|0.1|1] [--epochs N] [--lrs 3e-4,1e-3,3e-3]
                   [--classifier auto|linear|cosine] [--resume auto] [--wise 0,0.25,0.5,0.75,1]

OUT holds ``finetune.json`` (the settings, to refuse a resume with others), ``sweep/lr_<i>/`` (per
learning rate: per-epoch checkpoints and ``best/``), ``model/`` (the best validation epoch of the
chosen learning rate: ``model.safetensors`` + ``finetune.json``), ``results.json`` and
``report.html``, the documents of ``nclip eval`` (so ``nclip eval compare`` tabulates them): keys
``finetune/<dataset>-<kind>/top1`` (top5, mean_per_class, chance, val_top1), and in ``config``
the settings with the chosen ``lr``, the ``fraction`` and the per-class label counts (with ``--wise``:
``config.wise``, the metrics of each WiSE-FT mix, :mod:`nclip.finetune.wise`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

from nclip import plugin_consent
from nclip.defaults import DEVICES
from nclip.errors import NclipError
from nclip.finetune.settings import FinetuneSettings, validated
from nclip.jsonio import write_text_atomic, writing
from nclip.overwrite import FINETUNE, check_output_folder
from nclip.runlock import LOCK_NAME

STATE = "finetune.json"
assert FINETUNE.markers == (STATE,)  # how nclip.overwrite tells a fine-tuning's folder


def add_finetune_parser(sub) -> argparse.ArgumentParser:
    d = FinetuneSettings()
    p = sub.add_parser("finetune", help="fine-tune a checkpoint's image tower on labelled images (xCLIP Tab. 6)",
                       description="End-to-end fine-tuning with layer-wise lr decay, weight decay, drop path and an "
                                   "lr sweep chosen on a validation split of the training labels (xCLIP App. C); "
                                   "docs/finetune.md.")
    p.add_argument("--checkpoint", type=Path, required=True, help="run directory, model directory or "
                   "RUN/checkpoints/step_N")
    p.add_argument("--dataset", default=d.dataset, help="digits | synthetic (shape labels) | folder:DIR")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--fraction", type=float, default=d.fraction, help="share of the training labels, in (0, 1] "
                   "(class-balanced, seeded, at least one per class; Tab. 6: 0.01, 0.1, 1)")
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--lrs", default=",".join(f"{v:g}" for v in d.lrs), help="learning rates of the sweep")
    p.add_argument("--classifier", choices=["auto", "linear", "cosine"], default=d.classifier,
                   help="cosine: CLIP head + text-initialised cosine classifier (step 0 = zero-shot); linear: "
                        "backbone + linear; auto: cosine with a CLIP head and fraction < 1, else linear")
    p.add_argument("--layer-decay", type=float, default=d.layer_decay)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--drop-path", type=float, default=d.drop_path)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--val-fraction", type=float, default=d.val_fraction,
                   help="share of each class of the training split held out for the lr/epoch choice")
    p.add_argument("--samples", type=int, default=d.test_samples, help="synthetic test scenes")
    p.add_argument("--train-samples", type=int, default=d.train_samples, help="synthetic training scenes")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", choices=DEVICES, default=d.device)
    p.add_argument("--resume", choices=["auto", "never"], default="never",
                   help="auto: continue the fine-tuning in --out from its newest checkpoints")
    p.add_argument("--wise", default="", metavar="ALPHAS",
                   help="WiSE-FT: evaluate these mixes of the zero-shot start (0) and the fine-tuned weights (1), "
                        "e.g. 0,0.25,0.5,0.75,1 (needs the cosine classifier)")
    p.add_argument("--no-report", action="store_true", help="write results.json only")
    p.add_argument("--force", action="store_true", help="write into an --out that holds other files (never a "
                   "run, a checkpoint or another command's output; a fine-tuning run there continues with "
                   "--resume auto)")
    p.add_argument("--quiet", action="store_true", help="no progress messages")
    plugin_consent.add_flag(p)
    return p


def run_finetune_command(args) -> int:
    try:
        lrs = tuple(float(v) for v in args.lrs.split(",") if v.strip())
    except ValueError:
        raise NclipError(f"finetune: --lrs: expected comma-separated numbers, got {args.lrs!r}") from None
    try:
        wise = tuple(float(v) for v in args.wise.split(",") if v.strip())
    except ValueError:
        raise NclipError(f"finetune: --wise: expected comma-separated numbers in [0, 1], got {args.wise!r}") from None
    settings = validated(dict(
        dataset=args.dataset, fraction=args.fraction, classifier=args.classifier, epochs=args.epochs, lrs=lrs,
        layer_decay=args.layer_decay, weight_decay=args.weight_decay, drop_path=args.drop_path,
        batch_size=args.batch_size, val_fraction=args.val_fraction, test_samples=args.samples,
        train_samples=args.train_samples, seed=args.seed, device=args.device, wise=wise))
    log = (lambda msg: None) if args.quiet else (lambda msg: print(f"finetune: {msg}", file=sys.stderr, flush=True))
    doc = run_finetune(args.checkpoint, args.out, settings, resume=args.resume == "auto",
                       report=not args.no_report, log=log, force=args.force)
    r = doc["results"]
    key = next(k for k in r if k.endswith("/top1"))
    print(f"{key}  {100 * r[key]:.1f}  (lr {doc['config']['lr']:g}, epoch {doc['config']['best_epoch']}, "
          f"{doc['config']['train_images']} labelled images)\nresults  {Path(args.out) / 'results.json'}")
    if doc["config"].get("wise"):
        from nclip.finetune.wise import table_text

        print(table_text(doc["config"]["wise"]))
    return 0


def run_finetune(checkpoint, out, settings: FinetuneSettings, resume: bool = False, report: bool = True,
                 log: Callable[[str], None] = lambda msg: None, force: bool = False) -> dict:
    """Fine-tune ``checkpoint`` at every lr of ``settings.lrs``, choose the lr and epoch on the
    validation split, test the chosen weights; write ``out`` (see the module docstring). ``out``
    is locked for the whole of it: a second writer is refused (:mod:`nclip.runlock`)."""
    from nclip.runlock import DirLock

    if force:  # never a run, a checkpoint or another command's output, before anything is written
        check_output_folder(Path(out).expanduser(), "--out", FINETUNE)
    with DirLock(out, "nclip finetune"):
        return _run_finetune(checkpoint, Path(out).expanduser(), settings, resume, report, log, force)


def _run_finetune(checkpoint, out: Path, settings: FinetuneSettings, resume: bool, report: bool,
                  log: Callable[[str], None], force: bool) -> dict:
    import torch

    from nclip.eval import zeroshot
    from nclip.eval.checkpoint import resolve_checkpoint
    from nclip.eval.runner import _device
    from nclip.finetune.data import prepare
    from nclip.finetune.layers import layer_count, lr_scale
    from nclip.finetune.loop import load_best, predict, run_lr
    from nclip.finetune.network import build_net, resolve_classifier
    from nclip.finetune.wise import check_wise, wise_table
    from nclip.models.io import atomic_dir

    t0 = time.perf_counter()
    ck = resolve_checkpoint(checkpoint)
    classifier = resolve_classifier(settings.classifier, ck.cfg, settings.fraction)
    check_wise(settings.wise, classifier)
    device = _device(settings.device)
    prep = prepare(ck.cfg, settings)  # before OUT is claimed: bad data leaves nothing to resume
    _plan(out, settings, ck.sha256, resume, force)
    vision_cfg = ck.cfg.model.vision
    log(f"{prep.name}-{prep.kind}: {len(prep.labelled.train_images)} labelled training images "
        f"(fraction {settings.fraction:g}), {len(prep.labelled.val_labels)} validation, "
        f"{len(prep.test_labels)} test; {classifier} classifier")

    def make_net():
        torch.manual_seed(settings.seed)  # the linear classifier is zero-initialised; BN etc. from the checkpoint
        return build_net(ck, classifier, prep.space, device)

    sweep = [run_lr(make_net, vision_cfg, lr, i, prep.labelled, settings, out / "sweep" / f"lr_{i}", log)
             for i, lr in enumerate(settings.lrs)]
    chosen = max(sweep, key=lambda r: r.best_val)  # ties: the first (max keeps the first maximum)
    net = load_best(make_net(), chosen.best_dir)
    metrics, _ = zeroshot.evaluate(predict(net, prep.test_pixels), prep.test_labels)
    wise = wise_table(make_net, net, settings.wise, prep, log) if settings.wise else None
    with writing(out / "model"), atomic_dir(out / "model") as tmp:  # a full disk: one line naming it
        shutil.copyfile(chosen.best_dir / "model.safetensors", tmp / "model.safetensors")
        (tmp / STATE).write_text(json.dumps({"classifier": classifier, "classes": list(prep.space.names),
                                             "lr": chosen.lr, "epoch": chosen.best_epoch,
                                             "checkpoint": str(ck.path)}, indent=2) + "\n")
    name = f"{prep.name}-{prep.kind}"
    results = {f"finetune/{name}/{k}": v for k, v in metrics.items()}
    results[f"finetune/{name}/val_top1"] = chosen.best_val
    count = layer_count(vision_cfg)
    config = {**settings.model_dump(), "classifier": classifier, "lr": chosen.lr, "best_epoch": chosen.best_epoch,
              "train_images": len(prep.labelled.train_images), "val_images": len(prep.labelled.val_labels),
              "test_images": len(prep.test_labels), "per_class_train": prep.per_class,
              "drop_path_applied": chosen.drop_path,
              "layer_lr_scale": [round(lr_scale(i, count, settings.layer_decay), 6) for i in range(count)],
              "features": "CLIP head g (cosine classifier)" if classifier == "cosine"
              else f"backbone: {ck.vision_tower.feature}",
              "sweep": [{"lr": r.lr, "best_val_top1": r.best_val, "best_epoch": r.best_epoch, "history": r.history}
                        for r in sweep]}
    if wise:
        config["wise"] = wise
    doc = _document(ck, classifier, config, results, time.perf_counter() - t0)
    _write(out, doc, ck, report)
    return doc


def _plan(out: Path, settings: FinetuneSettings, sha: str, resume: bool, force: bool = False) -> None:
    """Refuse to mix runs: an OUT that holds a fine-tuning run continues only with ``--resume
    auto`` and the same settings (the device may change) and checkpoint; one that holds other
    files (an evaluation's results.json and report.html, which ours would replace) only with
    ``force``."""
    state = out / STATE
    mine = {"settings": settings.model_dump(mode="json", exclude={"device", "wise"}), "checkpoint_sha256": sha}
    if state.is_file():
        if not resume:
            raise NclipError(f"{out} already holds a fine-tuning run: continue it with --resume auto "
                             "(or choose another --out)")
        from nclip.jsonio import read_json

        saved = read_json(state)
        if saved.get("checkpoint_sha256") != sha:
            raise NclipError(f"cannot resume {out}: it fine-tunes another checkpoint")
        now = json.loads(json.dumps(mine["settings"]))  # tuples as the file's lists
        diffs = [k for k, v in now.items() if saved.get("settings", {}).get(k) != v]
        if diffs:
            raise NclipError(f"cannot resume {out} with other settings ({', '.join(diffs)} differ)")
        return
    if (out / "sweep").exists():
        raise NclipError(f"{out} holds fine-tuning checkpoints but no {STATE}: choose another --out")
    held = sorted(p.name for p in out.iterdir() if p.name != LOCK_NAME) if out.is_dir() else []
    if held and not force:
        raise NclipError(f"finetune: --out {out} already holds other files ({held[0]}"
                         f"{', ...' if len(held) > 1 else ''}); choose another --out, or pass --force to write beside "
                         "them (results.json and report.html are replaced)")
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(state, json.dumps(mine, indent=2) + "\n")


def _document(ck, classifier: str, config: dict, results: dict, seconds: float) -> dict:
    from nclip.eval.runner import RESULTS_VERSION, checkpoint_info
    from nclip.objectives import plan_for

    objective = plan_for(ck.cfg)
    return {"version": RESULTS_VERSION,
            "checkpoint": checkpoint_info(ck, objective, "clip" if classifier == "cosine" else None),
            "config": config, "results": dict(sorted(results.items())), "skipped": {},
            "timing": {"total_s": seconds}, "cache": {"dir": None, "hits": [], "misses": []}}


def _write(out: Path, doc: dict, ck, report: bool) -> None:
    from nclip.jsonio import jsonable

    write_text_atomic(out / "results.json", json.dumps(jsonable(doc, lambda v: None), indent=2) + "\n")
    if report:
        from nclip.eval.probe import threads
        from nclip.eval.report import render

        with threads(1):
            write_text_atomic(out / "report.html", render(doc, {}, ck))
