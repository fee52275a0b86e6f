"""``nclip merge A B --alpha 0.5 --out C``: WiSE-FT weight interpolation of two runs or model
directories (:mod:`nclip.models.merge`; docs/merge.md). The parser is light: torch loads when the
command runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from nclip import plugin_consent


def add_merge_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("merge", help="interpolate the weights of two models of one architecture (WiSE-FT)",
                       description="Write (1 - alpha) * A + alpha * B (floating-point tensors; integer buffers "
                                   "and the config from A) as an nclip model directory; docs/merge.md.")
    p.add_argument("a", type=Path, help="run directory or model directory (alpha 0)")
    p.add_argument("b", type=Path, help="run directory or model directory of the same architecture (alpha 1)")
    p.add_argument("--alpha", type=float, required=True, help="weight of B, in [0, 1]")
    p.add_argument("--out", type=Path, required=True, help="the model directory to write")
    p.add_argument("--force", action="store_true", help="write over a non-empty --out (never a run)")
    plugin_consent.add_flag(p)
    return p


def run_merge_command(args) -> int:
    from nclip.models.merge import check_alpha, describe, merge

    check_alpha(args.alpha)  # before anything is read
    print(describe(merge(args.a, args.b, args.alpha, args.out, force=args.force)))
    return 0
