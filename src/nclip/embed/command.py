"""The ``nclip embed`` and ``nclip search`` subcommands (registered by :mod:`nclip.cli`).

    nclip embed SPEC --checkpoint M --out DIR [--batch-size N] [--shard-size N] [--force] [--no-progress]
    nclip search DIR (--text "a red circle" | --image FILE) [-k 10] [--json] [--checkpoint M]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from nclip import plugin_consent
from nclip.defaults import DEVICES
from nclip.errors import NclipError

_SPEC_HELP = ("data to embed: anything nclip eval --dataset takes (synthetic | digits | folder:DIR | captions:FILE | "
              "imagefolder:DIR | wds:DIR[:SPLIT] | karpathy:FILE.json:IMAGES ...; every split), a .csv/.tsv/.jsonl "
              "of image paths and captions, or training WebDataset shards (shards:PATTERN, a .tar pattern or a "
              "directory of .tar)")


def add_embed_parser(sub) -> argparse.ArgumentParser:
    from nclip.embed.manifest import DEFAULT_BATCH_SIZE, DEFAULT_SHARD_SIZE  # light: no numpy, no torch

    p = sub.add_parser("embed", help="embed a dataset with a model: float16 .npy shards, metadata, a Faiss index "
                       "(docs/embed.md)",
                       description="Embed the images (and captions) of a dataset in the model's zero-shot space. "
                                   "A killed run continues when the same command is run again.")
    p.add_argument("spec", metavar="SPEC", help=_SPEC_HELP)
    p.add_argument("--checkpoint", required=True, help="anything nclip.load takes: a run or model directory, "
                   "RUN/checkpoints/step_N, a transformers CLIP directory, an open_clip directory or state dict")
    p.add_argument("--out", required=True, type=Path, help="output directory (a non-empty one that is not this "
                   "embedding's is refused unless --force)")
    p.add_argument("--arch", metavar="NAME", help="open_clip config of an open_clip/OpenAI state-dict --checkpoint")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    p.add_argument("--shard-size", type=int, default=DEFAULT_SHARD_SIZE, help="rows per .npy shard")
    p.add_argument("--samples", type=int, default=1000, help="synthetic scenes per split (built-in data)")
    p.add_argument("--seed", type=int, default=0, help="seed of built-in data and of folder: data's split")
    p.add_argument("--image-key", help="image-path column of a CSV (default: as nclip eval)")
    p.add_argument("--caption-key", help="caption column of a CSV (default: as nclip eval)")
    p.add_argument("--device", choices=DEVICES, default="auto")
    p.add_argument("--force", action="store_true", help="replace another model's or other settings' embeddings")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    plugin_consent.add_flag(p)
    return p


def add_search_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("search", help="search an nclip embed directory by text or image",
                       description="Rank the rows of an nclip embed directory by the cosine of their image "
                                   "embeddings to a query: --text and --image both search the image index. The "
                                   "query is encoded by the model the directory's manifest names.")
    p.add_argument("directory", type=Path, metavar="DIR", help="a directory written by nclip embed")
    q = p.add_mutually_exclusive_group(required=True)
    q.add_argument("--text", help="a caption; ranks the images")
    q.add_argument("--image", type=Path, metavar="FILE", help="an image file; ranks the images")
    p.add_argument("-k", type=int, default=10, help="rows to return (default 10)")
    p.add_argument("--json", action="store_true", help="print the hits as JSON")
    p.add_argument("--checkpoint", help="encode the query with this model (its weights must be the manifest's)")
    p.add_argument("--arch", metavar="NAME", help="open_clip config of an open_clip/OpenAI state-dict --checkpoint")
    p.add_argument("--device", choices=DEVICES, default="auto")
    plugin_consent.add_flag(p)
    return p


def run_embed_command(args) -> int:
    if args.batch_size < 1 or args.shard_size < 1 or args.samples < 1:
        raise NclipError("embed: --batch-size, --shard-size and --samples must be >= 1")
    from nclip.embed.writer import embed

    doc = embed(args.spec, args.checkpoint, args.out, arch=args.arch, batch_size=args.batch_size,
                shard_size=args.shard_size, device=args.device, samples=args.samples, seed=args.seed,
                image_key=args.image_key, caption_key=args.caption_key, force=args.force,
                progress=not args.no_progress)
    texts = " and texts" if doc["settings"]["texts"] else ""
    print(f"embedded {doc['rows']} images{texts} in {len(doc['shards'])} shards: {args.out} "
          f"({doc['settings']['embedding']}, {doc['dim']} dims)")
    if doc.get("skipped_count"):
        print(f"left out {doc['skipped_count']} shard records (listed in {args.out / 'manifest.json'})",
              file=sys.stderr)
    return 0


def run_search_command(args) -> int:
    if args.k < 1:
        raise NclipError(f"search: -k must be >= 1, got {args.k}")
    from nclip.embed.manifest import read_manifest

    read_manifest(args.directory)  # a DIR without embeddings answers before numpy and torch load
    from nclip.embed.index import Index, open_image

    query = open_image(args.image) if args.image is not None else None  # a bad file answers before the model loads
    index = Index.open(args.directory, args.checkpoint, args.arch, args.device)
    hits = index.search_text(args.text, args.k) if query is None else index.search_image(query, args.k)
    if args.json:
        print(json.dumps([h.as_dict() for h in hits], indent=2))
        return 0
    for rank, h in enumerate(hits, 1):
        what = h.path if h.path is not None else f"row {h.row}"
        extra = "".join(f"  {v}" for v in (h.caption, h.label) if v is not None)
        print(f"{rank:>3}  {h.score:.4f}  {what}{extra}")
    return 0
