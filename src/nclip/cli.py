"""The ``nclip`` command line: ``nclip train | export | presets | config``.

Errors the user can fix (bad config, missing files, malformed input) print one line,
``nclip: error: ...``, and exit with status 2; nothing prints a traceback for them.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from nclip.errors import NclipError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, like every other user error
        raise NclipError(f"{self.prog}: {message}")


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny", help="preset name (see `nclip presets`) or a YAML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.steps=100 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="nclip", description="Language-image pre-training beyond the contrastive objective.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("train", help="train a dual encoder")
    _add_config_args(p)
    p.add_argument("--out", required=True, type=Path, help="run directory")
    p.add_argument("--resume", choices=["auto", "never"], default="never",
                   help="auto: continue from the newest complete checkpoint in --out")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--no-eval", action="store_true", help="skip the end-of-run evaluation")

    p = sub.add_parser("config", help="print the resolved, validated config")
    _add_config_args(p)

    sub.add_parser("presets", help="list the shipped presets")

    p = sub.add_parser("export", help="export a trained model")
    p.add_argument("--checkpoint", required=True, type=Path, help="run directory or model directory")
    p.add_argument("--hf", required=True, type=Path, help="write a transformers CLIPModel directory here")
    return parser


def _cmd_train(args) -> int:
    from nclip.config import resolve
    from nclip.train.loop import train

    cfg = resolve(args.preset, args.overrides)
    result = train(cfg, args.out, resume=args.resume == "auto", progress=not args.no_progress,
                   evaluate=not args.no_eval)
    print(_summary(result))
    return 0


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
    from nclip.config import preset_names

    print("\n".join(preset_names()))
    return 0


def _cmd_export(args) -> int:
    from nclip.models.export import export_hf

    print(export_hf(args.checkpoint, args.hf))
    return 0


COMMANDS = {"train": _cmd_train, "config": _cmd_config, "presets": _cmd_presets, "export": _cmd_export}


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded at run time
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except NclipError as e:
        print(f"nclip: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("nclip: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
