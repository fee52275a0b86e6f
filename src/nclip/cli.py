"""The ``nclip`` command line: ``nclip train | config | presets | export | data | sweep | bench | eval |
finetune | embed | search | merge`` (the parsers of eval, finetune, embed and search: their ``command`` modules).

Errors the user can fix (bad config, missing files, malformed input) print one line,
``nclip: error: ...``, and exit with status 2; nothing prints a traceback for them.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from pathlib import Path

from nclip import plugin_consent
from nclip.errors import NclipError, SourceError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, like every other user error
        raise NclipError(f"{self.prog}: {message}")


def _add_config_args(p: argparse.ArgumentParser, default: str | None = "tiny", default_help: str = "tiny") -> None:
    p.add_argument("--preset", default=default,
                   help=f"preset name (see `nclip presets`) or a YAML file (default: {default_help})")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.steps=100 (repeatable)")


def _add_key_args(p: argparse.ArgumentParser, caption: bool) -> None:
    """--image-key (and --caption-key): a CSV's columns, spelt as in `nclip eval`; the old spellings
    --csv-image-key / --csv-caption-key still work, unlisted."""
    keys = [("image", "filepath", "image-path")] + ([("caption", "title", "caption")] if caption else [])
    for key, default, what in keys:
        p.add_argument(f"--{key}-key", dest=f"{key}_key", default=default,
                       help=f"{what} column of a CSV source (default: {default}, as data.csv_{key}_key)")
        p.add_argument(f"--csv-{key}-key", dest=f"{key}_key", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="nclip", description="Language-image pre-training beyond the contrastive objective.")
    from nclip import __version__

    parser.add_argument("--version", action="version", version=f"nclip {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("train", help="train a dual encoder")
    _add_config_args(p, default=None, default_help="tiny; continuing a run: its own config.yaml")
    p.add_argument("--out", required=True, type=Path, help="run directory (one that holds a run is refused, "
                   "unless --resume auto or --force)")
    p.add_argument("--resume", choices=["auto", "never"], default="never",
                   help="auto: continue from the newest complete checkpoint in --out, with the run's config "
                   "(only logging, checkpointing, threads, stop thresholds and eval may change; docs/runs.md)")
    p.add_argument("--extend-to", type=_positive_int, metavar="STEPS",
                   help="continue the run in --out to STEPS steps in all (implies --resume auto); the lr "
                   "follows the run's schedule to its end, then stays at train.min_lr")
    p.add_argument("--force", action="store_true",
                   help="start over in an --out that holds a run: its checkpoints, logs, model, eval and "
                   "config.yaml are removed first (other files are kept)")
    p.add_argument("--init", metavar="PATH", help="start from a pretrained model: a local transformers CLIPModel "
                   "directory, an open_clip directory or weights file, OpenAI's .pt, or an nclip run/model "
                   "directory (sets model.init; docs/transfer.md)")
    p.add_argument("--arch", metavar="NAME", help="open_clip config (e.g. ViT-B-32) of an open_clip/OpenAI "
                   "state-dict file given to --init (sets model.init_arch; default: read from its tensors as "
                   "OpenAI's)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar: one line per log step instead "
                   "(step, loss, the objective's terms, lr, samples/s), for logs and batch jobs")
    p.add_argument("--no-eval", action="store_true", help="skip the end-of-run evaluation")
    plugin_consent.add_flag(p)  # continuing a received run, or --init from a received model

    p = sub.add_parser("config", help="print the resolved, validated config")
    _add_config_args(p)

    sub.add_parser("presets", help="list the shipped presets, one line each")

    p = sub.add_parser("export", help="export a trained model (docs/export.md)")
    p.add_argument("--checkpoint", required=True, type=Path, help="run directory or model directory")
    out = p.add_mutually_exclusive_group(required=True)  # one format per export, each to a new or empty folder
    out.add_argument("--hf", type=Path, help="write a transformers CLIPModel directory here")
    out.add_argument("--open-clip", type=Path, help="write open_clip's hub layout here (open_clip_config.json, "
                     "open_clip_model.safetensors)")
    out.add_argument("--onnx", type=Path, help="write image_encoder.onnx, text_encoder.onnx and onnx_config.json "
                     "here (needs nclip[onnx])")
    p.add_argument("--force", action="store_true", help="write over a non-empty export directory (never a run)")
    plugin_consent.add_flag(p)

    p = sub.add_parser("data", help="export built-in data to shards, inspect a data source")
    data = p.add_subparsers(dest="data_command", required=True, parser_class=_Parser)
    q = data.add_parser("write-shards", help="write a built-in dataset as img2dataset-style tar shards, or any "
                        "evaluation dataset as CLIP_benchmark's WebDataset copy (--layout clip_benchmark)")
    _add_config_args(q)
    q.add_argument("--layout", default="img2dataset", choices=["img2dataset", "clip_benchmark"],
                   help="img2dataset: training shards of a built-in dataset; clip_benchmark: classnames.txt, "
                   "zeroshot_classification_templates.txt, test/ (and train/) shards, as CLIP_benchmark reads "
                   "them (docs/eval-data.md)")
    q.add_argument("--split", choices=["train", "val", "test"], help="the split to write (img2dataset default: "
                   "train; clip_benchmark default: test, and train where the dataset has one)")
    q.add_argument("--count", type=int, help="samples to write (img2dataset: required; clip_benchmark: the first "
                   "COUNT of each split, and the built-in data's size; default: nclip eval's)")
    q.add_argument("--out", required=True, type=Path, help="directory for 00000.tar, 00001.tar, ... (clip_benchmark: "
                   "a new or empty folder)")
    q.add_argument("--shard-size", type=int, default=1000, help="samples per shard")
    q.add_argument("--format", choices=["jpg", "png", "webp"], help="image encoding (default: jpg; clip_benchmark: "
                   "webp, lossless; its JPEG, PNG and WebP files are copied as they are)")
    q.add_argument("--dataset", metavar="SPEC", help="clip_benchmark: the dataset, as nclip eval --dataset "
                   "(synthetic, digits, folder:DIR, captions:FILE.csv, ...; default: the preset's data.source)")
    q.add_argument("--label", metavar="KIND", help="clip_benchmark: the label kind whose classes are written "
                   "(default: the dataset's first, e.g. shape for synthetic, class for folders)")
    q.add_argument("--retrieval", action="store_true", help="clip_benchmark: write the captions for retrieval "
                   "(the default for a captions file)")
    q.add_argument("--classnames", metavar="FILE", help="clip_benchmark: class names, as nclip eval --classnames")
    q.add_argument("--templates", metavar="FILE|imagenet80", help="clip_benchmark: prompt templates, as nclip "
                   "eval --templates")
    q.add_argument("--image-key", help="clip_benchmark: image-path column of a captions CSV")
    q.add_argument("--caption-key", help="clip_benchmark: caption column of a captions CSV")
    q = data.add_parser("inspect", help="summarise a shard pattern, shard directory or CSV/TSV/JSONL file")
    q.add_argument("source", help="e.g. '/data/{00000..00009}.tar', a directory of .tar, or pairs.csv")
    q.add_argument("--limit", type=int, default=10000, help="read at most this many samples")
    _add_key_args(q, caption=True)
    q.add_argument("--caption-separator", help="splits a caption cell into several (as data.caption_separator)")
    q.add_argument("--json-caption-key", help="shards: the .json field of the captions (as data.json_caption_key)")
    q.add_argument("--hard-negative-key", help="the column or .json field of negatives (as data.hard_negative_key)")
    q.add_argument("--json", action="store_true", help="print the summary as JSON")
    q = data.add_parser("dedup", help="find target images that duplicate reference images by dHash "
                        "(OmniBenchmark Sec. 3.4): duplicates.json, duplicates.html, a filtered target")
    _add_config_args(q)  # the settings (seed, image size, length) of built-in sources
    sources = ("an image folder, a .csv/.tsv file, a shard pattern or directory of .tar, "
               "or synthetic[:SPLIT[:N]] / digits[:SPLIT[:N]]")
    q.add_argument("--reference", required=True, help=f"images to compare against: {sources}")
    q.add_argument("--target", required=True, help="images to check (and filter), same kinds")
    q.add_argument("--max-distance", type=int, default=0, metavar="D",
                   help="largest Hamming distance between 64-bit dHashes that counts as a duplicate (default 0)")
    q.add_argument("--out", type=Path, help="write duplicates.json and duplicates.html here")
    q.add_argument("--write-filtered", action="store_true",
                   help="also write the target without its duplicates (filtered.csv/.tsv, or filtered.txt)")
    _add_key_args(q, caption=False)
    q.add_argument("--workers", type=int, help="hashing threads (default: up to 4, one per core)")
    q.add_argument("--fast-jpeg", action="store_true", help="decode JPEGs at reduced scale (about 3x faster on "
                   "500x375; changes some hashes by a bit or so: hash both sides this way and use D >= 2)")

    p = sub.add_parser("sweep", help="run an ablation grid (Tab. 9 / Tab. A1): table.md, table.csv, curves.png")
    _add_config_args(p)
    p.add_argument("--grid", action="append", default=[], metavar="'KEY=[V1,V2] ...'",
                   help="cartesian grid, e.g. \"objective.lambda1=[0,0.3,0.5] objective.lambda2=[1,1.5]\" (repeatable)")
    p.add_argument("--grid-file", type=Path, help="YAML file with 'grid:' and/or named 'settings:'")
    p.add_argument("--table", help="named settings of a paper table: a1 (Tab. A1), 9a, 9c, 9d, 9e, 9f "
                   "(9c: --preset nclip-tiny; 9d, 9e, 9f: an xclip preset, 9f with data.sources)")
    p.add_argument("--out", required=True, type=Path, help="sweep directory (runs in OUT/runs/<slug>)")
    p.add_argument("--parallel", type=int, help="runs at once (default: cores // threads per run)")
    p.add_argument("--threads", type=int, help="train.threads of each run (default 1, or cores // --parallel)")
    p.add_argument("--resume", action="store_true", help="skip finished runs, continue the others")
    p.add_argument("--force", action="store_true", help="write a sweep into an --out that holds other files "
                   "(never over another sweep: --resume continues that one)")
    p.add_argument("--probe-train", type=int, default=2000, help="held-out images to fit the linear probe")
    p.add_argument("--probe-test", type=int, default=1000, help="held-out images to test the linear probe")

    p = sub.add_parser("bench", help="speed and memory as ratios measured in one run (docs/performance.md)")
    _add_config_args(p, default="micro", default_help="micro; on a GPU e.g. vit-b16-xclip")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the figures to FILE as JSON")
    p.add_argument("--compare", action="append", default=[], choices=["open_clip"],
                   help="add another library's training step (where it is installed)")
    p.add_argument("--quick", action="store_true", help="a smoke test: every row, measured briefly")
    p.add_argument("--memory-gib", type=float, metavar="G",
                   help="the largest-batch rows' memory limit (default: a GPU's free memory; 8 on the CPU)")
    from nclip.bench.budget import DEFAULT_BUDGET_S  # light: math and time only

    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, metavar="S",
                   help="wall seconds for the whole bench; rows that would not fit are skipped and say so "
                        f"(default {DEFAULT_BUDGET_S:.0f}; 0: no limit)")

    from nclip.eval.command import add_eval_parser  # light: the eval machinery loads when it runs

    add_eval_parser(sub)
    from nclip.finetune.command import add_finetune_parser  # light, as eval's

    add_finetune_parser(sub)
    from nclip.embed.command import add_embed_parser, add_search_parser  # light, as eval's

    add_embed_parser(sub)
    add_search_parser(sub)

    p = sub.add_parser("merge", help="interpolate the weights of two models of one architecture (WiSE-FT)",
                       description="Write (1 - alpha) * A + alpha * B (floating-point tensors; integer buffers "
                                   "and the config from A) as an nclip model directory; docs/merge.md.")
    p.add_argument("a", type=Path, help="run directory or model directory (alpha 0)")
    p.add_argument("b", type=Path, help="run directory or model directory of the same architecture (alpha 1)")
    p.add_argument("--alpha", type=float, required=True, help="weight of B, in [0, 1]")
    p.add_argument("--out", type=Path, required=True, help="the model directory to write")
    p.add_argument("--force", action="store_true", help="write over a non-empty --out (never a run)")
    plugin_consent.add_flag(p)
    return parser


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of steps, got {text!r}")
    return int(text)


def _cmd_train(args) -> int:
    from nclip.config import resolve

    resume = args.resume == "auto" or args.extend_to is not None
    init = [f"model.init={json.dumps(args.init)}"] if args.init else []  # a JSON string is a YAML string
    init += [f"model.init_arch={json.dumps(args.arch)}"] if args.arch else []
    asks = "--extend-to" if args.extend_to else "--resume auto" if resume else ""  # to continue a run
    preset = _train_preset(args.preset, args.out, asks)
    # the user's --preset and --set consent to the plugin they name; a run's own config.yaml does not
    cfg = resolve(preset, [*args.overrides, *init], trust_plugin=args.preset is not None or not resume)
    from nclip.train.loop import train  # after the config: its mistakes answer before torch is imported

    result = train(cfg, args.out, resume=resume, progress=not args.no_progress, evaluate=not args.no_eval,
                   force=args.force, extend_to=args.extend_to, preset=preset)
    if not _is_rank0():
        return 0
    if result.already_finished:
        print(f"nclip: {args.out} already finished at step {result.steps}; nothing to do "
              "(--extend-to STEPS trains it further)", file=sys.stderr)
    else:
        print(_summary(result))
    return 0


def _train_preset(preset: str | None, out: Path, resume: str) -> str:
    """--preset if given; else, continuing a run (``resume``: the option that asks to), the run's
    own config.yaml (none: an error, never a new run of a preset nobody named); else tiny."""
    if preset:
        return preset
    if not resume:
        return "tiny"
    saved = out / "config.yaml"
    if not saved.is_file():
        what = "does not exist" if not out.exists() else "has no config.yaml"
        verb = "extend" if resume == "--extend-to" else "continue"
        raise NclipError(f"{resume}: {out} holds no run to {verb} ({what}); check --out, "
                         "or give --preset to start a new run there")
    return str(saved)


def _summary(result) -> str:
    rows = [("run", str(result.run_dir)), ("steps", str(result.steps))]
    m = result.metrics
    if m:
        rows.append(("final loss", f"{m.get('loss', float('nan')):.4f}"))
        rows.append(("samples/s (last window)", f"{m.get('samples_per_s', 0):.0f}"))
    for key in sorted(result.eval):
        value = result.eval[key]
        if key.startswith(("zeroshot/", "retrieval/")):
            rows.append((key, f"{value:.3f}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _cmd_config(args) -> int:
    from nclip.config import resolve, to_yaml

    print(to_yaml(resolve(args.preset, args.overrides)), end="")
    return 0


def _cmd_presets(args) -> int:
    from nclip.config_files import preset_table  # light: no pydantic, no torch

    print(preset_table())
    return 0


def _cmd_export(args) -> int:
    from nclip.models.export_base import model_dir
    from nclip.models.exporters import FORMATS, export
    from nclip.runlock import DirLock
    from nclip.train.rundir import check_export_target

    fmt = next(f for f in FORMATS if getattr(args, f) is not None)  # argparse lets exactly one through
    out, option = getattr(args, fmt), FORMATS[fmt]
    check_export_target(model_dir(args.checkpoint), out, args.force, option)
    with DirLock(out, "nclip export", option):  # one writer; checked again under the lock
        check_export_target(model_dir(args.checkpoint), out, args.force, option)
        print(export(fmt, args.checkpoint, out))
    return 0


def _cmd_sweep(args) -> int:
    from pydantic import ValidationError

    from nclip.config import describe_validation_error
    from nclip.sweep import SweepOptions, load_grid_file, parse_grid, run_sweep, table_settings

    grid, settings = parse_grid(args.grid), None
    if args.grid_file:
        file_grid, settings = load_grid_file(args.grid_file)
        if set(file_grid) & set(grid):
            raise NclipError(f"grid key {sorted(set(file_grid) & set(grid))[0]} is in both --grid and --grid-file")
        grid = {**file_grid, **grid}
    if args.table:
        if settings:
            raise NclipError("give either --table or settings in --grid-file, not both")
        settings = table_settings(args.table)
    def option(field: str) -> str:  # probe_train → --probe-train; "" for a check across options
        return "--" + field.replace("_", "-") if field else ""

    try:
        opts = SweepOptions(preset=args.preset, out=args.out, grid=grid, settings=settings, overrides=args.overrides,
                            parallel=args.parallel, threads=args.threads, resume=args.resume, force=args.force,
                            probe_train=args.probe_train, probe_test=args.probe_test,
                            source={"grid": args.grid, "grid_file": str(args.grid_file) if args.grid_file else None,
                                    "table": args.table})
    except ValidationError as e:  # one line, as the run config's: "sweep: --probe-train: ..."
        raise NclipError(describe_validation_error(e, "sweep", option)) from None
    run_sweep(opts, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print((args.out / "table.md").read_text(), end="")
    return 0


def _cmd_data(args) -> int:
    from nclip.data import tools

    if args.data_command == "write-shards":
        return _write_shards(args)
    if args.data_command == "dedup":
        from nclip.data.dedup_report import run_dedup

        def builtin_config(name: str):  # only built-in sources need a run config (and pay for importing it)
            from nclip.config import resolve

            # the preset's data settings with the source swapped in; not re-validated, since checks that tie
            # training options to a source (hard-negative groups need synthetic) do not matter for reading pixels
            cfg = resolve(args.preset, args.overrides)
            return cfg.model_copy(update={"data": cfg.data.model_copy(update={"source": name})})

        if args.workers is not None and args.workers < 1:
            raise NclipError(f"--workers must be >= 1, got {args.workers}")
        print(run_dedup(args.reference, args.target, args.max_distance, args.out, builtin_config,
                        write_filtered=args.write_filtered, csv_image_key=args.image_key, workers=args.workers,
                        fast_jpeg=args.fast_jpeg))
        return 0
    summary = tools.inspect_source(args.source, args.limit, csv_image_key=args.image_key,
                                   csv_caption_key=args.caption_key, caption_separator=args.caption_separator,
                                   json_caption_key=args.json_caption_key, hard_negative_key=args.hard_negative_key)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(tools.format_summary(summary))
    return 0


def _write_shards(args) -> int:
    from nclip.config import resolve

    cfg = resolve(args.preset, args.overrides)
    if args.layout == "clip_benchmark":
        from nclip.eval.wds_export import copy_dataset, describe

        written = copy_dataset(args.dataset or cfg.data.source, args.out, cfg, count=args.count,
                               classnames=args.classnames, templates=args.templates, image_key=args.image_key,
                               caption_key=args.caption_key, label=args.label, retrieval=args.retrieval,
                               split=args.split, shard_size=args.shard_size, image_format=args.format or "webp")
        print(describe(written))
        return 0
    only = [f"--{name.replace('_', '-')}" for name in ("dataset", "label", "retrieval", "classnames", "templates",
                                                       "image_key", "caption_key") if getattr(args, name)]
    if only:
        raise NclipError(f"{only[0]} needs --layout clip_benchmark (img2dataset shards are of a built-in dataset)")
    if args.count is None:
        raise NclipError("--count is required: the samples to write")
    from nclip.data import tools

    n, paths, pattern = tools.write_shards(cfg, args.split or "train", args.count, args.out, args.shard_size,
                                           args.format or "jpg")
    print(f"wrote {n} samples to {len(paths)} shard{'s' * (len(paths) != 1)}: {pattern}")
    return 0


def _cmd_bench(args) -> int:
    from nclip.bench.command import run_bench_command

    return run_bench_command(args)


def _cmd_eval(args) -> int:
    from nclip.eval.command import run_eval_command

    return run_eval_command(args)


def _cmd_finetune(args) -> int:
    from nclip.finetune.command import run_finetune_command

    return run_finetune_command(args)


def _cmd_embed(args) -> int:
    from nclip.embed.command import run_embed_command, run_search_command

    return (run_embed_command if args.command == "embed" else run_search_command)(args)


def _cmd_merge(args) -> int:
    from nclip.models.merge import check_alpha, describe, merge

    check_alpha(args.alpha)  # before anything is read
    print(describe(merge(args.a, args.b, args.alpha, args.out, force=args.force)))
    return 0


# every subcommand of build_parser's, and what runs it
COMMANDS = {"train": _cmd_train, "config": _cmd_config, "presets": _cmd_presets, "export": _cmd_export,
            "data": _cmd_data, "sweep": _cmd_sweep, "bench": _cmd_bench, "eval": _cmd_eval, "finetune": _cmd_finetune,
            "embed": _cmd_embed, "search": _cmd_embed, "merge": _cmd_merge}


def _is_rank0() -> bool:
    """Whether this process speaks for the run: always outside torchrun; under it, rank 0 only
    (every rank meets the same outcome, one reports it)."""
    return int(os.environ.get("RANK", "0") or 0) == 0


def _check_outputs(args) -> None:
    """Every output folder the command will write, checked before any work (a folder below a file,
    or one without write permission, is one line, not a traceback at the first write)."""
    from nclip.jsonio import check_writable_dir

    if isinstance(getattr(args, "out", None), Path):
        check_writable_dir(args.out, "--out")
    if isinstance(getattr(args, "compare_out", None), Path):
        check_writable_dir(args.compare_out, "--out")


def _fail(message: str) -> int:
    """A user error: one line on stderr, exit status 2. Under torchrun every rank meets the same
    error (rank 0 decides and tells the others, nclip.train.rundir.agree); rank 0 alone says it."""
    if _is_rank0():
        print(f"nclip: error: {message}", file=sys.stderr)
    return 2


# the options that name a model's files, which a SourceError about them names
SOURCE_OPTIONS = {"checkpoint": "--checkpoint", "baseline": "--baseline", "init": "--init"}


def _as_given(error: SourceError, args) -> SourceError:
    """``error`` naming its path as the user gave it: by its option and spelling where one of the
    command's options names that path, else as raised (``model.init`` inside a run)."""
    where = Path(error.path).expanduser().resolve()
    for attr, option in SOURCE_OPTIONS.items():
        value = getattr(args, attr, None)
        if value is not None and Path(value).expanduser().resolve() == where:
            return error.named(option, value)
    return error


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded at run time
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    args = None
    try:
        args = build_parser().parse_args(argv)
        _check_outputs(args)
        with plugin_consent.consent(getattr(args, "trust_plugin", False)):
            return COMMANDS[args.command](args)
    except SourceError as e:
        return _fail(str(_as_given(e, args)))
    except NclipError as e:
        return _fail(str(e))
    except OSError as e:  # a path the user gave that cannot be written or read as asked, or a full disk
        if e.filename is None and e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG):
            raise
        return _fail(f"{e.filename or 'cannot write'}: {e.strerror or e}")
    except KeyboardInterrupt:
        if _is_rank0():
            print(f"nclip: interrupted{_how_to_go_on(args)}", file=sys.stderr)
        return 130


def _how_to_go_on(args) -> str:
    """After a Ctrl-C: how to continue a training run (the exact command), or "" for the others."""
    if getattr(args, "command", None) != "train":
        return ""
    import shlex

    out = args.out
    if not (out / "config.yaml").is_file():
        return "; the run had not started: nothing was written, run the same command again"
    from nclip.models.io import checkpoint_step

    steps = sorted(n for n in map(checkpoint_step, (out / "checkpoints").glob("step_*")) if n is not None)
    since = f"from its step-{steps[-1]} checkpoint" if steps else "from step 0 (no checkpoint yet)"
    return f"; continue the run {since} with: nclip train --out {shlex.quote(str(out))} --resume auto"


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
