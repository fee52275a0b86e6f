"""Zero-shot classification of a folder of images with a trained run.

    python examples/zero_shot_folder.py runs/tiny my_photos/ "red circle" "blue star" "green square"
    python examples/zero_shot_folder.py runs/tiny my_photos/ circle star --template "a picture of a {}."
    python examples/zero_shot_folder.py runs/tiny pets/      # pets/cat/*.jpg, pets/dog/*.jpg: cat, dog

Prints one line per image (sorted by path, the folder searched recursively): the predicted class and
every class's score, scored with the run's own zero-shot head (CLIP's cosine, or nCLIP's −L_CE for
nCLIP runs) against the prompt ensemble of each class name. A folder with a sub-folder per class (as
`nclip eval --dataset folder:DIR` reads) needs no class names: they default to the sub-folders'
names, and the accuracy against them is printed last (on stderr). RUN may be a run directory, a
model directory or a training checkpoint (RUN/checkpoints/step_N).
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
    p.add_argument("folder", type=Path, help="folder of images, searched recursively (e.g. a sub-folder per class)")
    p.add_argument("classes", nargs="*", help="class names (default: the names of the folder's sub-folders)")
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
    paths = sorted(f for f in args.folder.rglob("*") if f.suffix.lower() in IMAGE_SUFFIXES and f.is_file())
    if not paths:
        raise NclipError(f"no images ({', '.join(IMAGE_SUFFIXES)}) in {args.folder} or below it")
    folders = sorted({f.parent.name for f in paths if f.parent != args.folder})  # a folder per class
    classes = args.classes or folders
    if not classes:
        raise NclipError(f"give the class names: {args.folder} has no sub-folders to take them from")
    model = nclip.load(args.run, device=args.device)
    images = [Image.open(f) for f in paths]
    scores = model.zero_shot(images, classes, templates=args.templates)  # [N, C], higher is better
    if model.logit_bias is not None:  # a SigLIP model's logits: its probabilities are their sigmoid
        scores = scores.sigmoid()
    predicted = [classes[int(row.argmax())] for row in scores]
    for path, best, row in zip(paths, predicted, scores):
        others = "  ".join(f"{name}={s:.3f}" for name, s in zip(classes, row.tolist()))
        print(f"{path.relative_to(args.folder)}\t{best}\t({others})")
    truth = [f.parent.name for f in paths]
    if all(t in classes for t in truth):  # every image in a folder named as its class
        right = sum(p == t for p, t in zip(predicted, truth))
        print(f"accuracy against the folder names: {right}/{len(paths)} = {right / len(paths):.3f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
