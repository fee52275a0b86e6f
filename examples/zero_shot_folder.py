"""Zero-shot classification of a folder of images with a trained run.

    python examples/zero_shot_folder.py runs/tiny my_photos/ "red circle" "blue star" "green square"
    python examples/zero_shot_folder.py runs/tiny my_photos/ circle star --template "a picture of a {}."

Prints one line per image (sorted by file name): the predicted class and every class's score,
scored with the run's own zero-shot head (CLIP's cosine, or nCLIP's −L_CE for nCLIP runs) against
the prompt ensemble of each class name. RUN may be a run directory, a model directory or a
training checkpoint (RUN/checkpoints/step_N).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from PIL import Image

import nclip
from nclip.data.folders import IMAGE_SUFFIXES
from nclip.errors import NclipError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path, help="run directory, model directory or RUN/checkpoints/step_N")
    p.add_argument("folder", type=Path, help="folder of images (not searched recursively)")
    p.add_argument("classes", nargs="+", help="class names")
    p.add_argument("--template", action="append", dest="templates", metavar="PROMPT",
                   help="prompt with one {} for the class name (repeatable; default: nclip eval's generic ones)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    args = p.parse_args(argv)
    try:
        return run(args)
    except NclipError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    if not args.folder.is_dir():
        raise NclipError(f"image folder not found: {args.folder}")
    paths = sorted(f for f in args.folder.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)
    if not paths:
        raise NclipError(f"no images ({', '.join(IMAGE_SUFFIXES)}) in {args.folder}")
    model = nclip.load(args.run, device=args.device)
    images = [Image.open(f) for f in paths]
    scores = model.zero_shot(images, args.classes, templates=args.templates)  # [N, C], higher is better
    for path, row in zip(paths, scores):
        best = int(row.argmax())
        others = "  ".join(f"{name}={s:.3f}" for name, s in zip(args.classes, row.tolist()))
        print(f"{path.name}\t{args.classes[best]}\t({others})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
