"""The bench row "embed images/s / bare forward": ``nclip embed``'s pipeline
(:func:`nclip.embed.writer.write_shards`: decoding threads, the zero-shot embedding, float16 shards
and metadata written to a temporary directory) over the model's bare ``encode_image`` on pixels made
before the clock, the same model at the same batch, measured side by side in this process.
The target is ≥ 0.9: loading overlaps encoding, so the pipeline costs little beyond the forward."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch


def embed_over_forward(cfg, n: int, device: torch.device) -> dict:
    """{"ratio", "embed_images_per_s", "forward_images_per_s", "images", "batch_size", "detail"} over
    ``n`` held-out synthetic scenes (:func:`nclip.bench.parts.scenes`), each side timed twice after a
    warm-up, alternating."""
    from nclip.bench.parts import scenes
    from nclip.bench.shared_models import build
    from nclip.data.transforms import eval_tensor
    from nclip.embed.model import Encoder
    from nclip.embed.sources import eval_rows
    from nclip.embed.writer import write_shards
    from nclip.eval.evaldata import EvalData

    encoder = Encoder(build(cfg).to(device), cfg, device)
    items = scenes(n, cfg.data.image_size)
    bs = min(cfg.eval.batch_size, n)

    def embed(samples) -> float:
        rows = eval_rows("bench", EvalData("bench", {}, splits={"test": samples}))
        doc = {"settings": {"batch_size": bs, "shard_size": n, "texts": False}, "shards": [], "rows": 0,
               "position": 0}
        with tempfile.TemporaryDirectory() as tmp:
            return _timed(device, lambda: write_shards(doc, Path(tmp), rows, encoder, progress=False))

    pixels = torch.stack([eval_tensor(s.image, encoder.image_size, encoder.resize) for s in items])

    @torch.no_grad()
    def forward(count: int) -> None:
        for i in range(0, count, bs):
            encoder.model.encode_image(pixels[i : i + bs].to(device))

    embed(items[:bs])
    _timed(device, lambda: forward(bs))  # warm-ups
    # alternating, the faster of two each: a busy machine slows one window, not one side
    times = [(embed(items), _timed(device, lambda: forward(n))) for _ in range(2)]
    embed_s, forward_s = min(t[0] for t in times), min(t[1] for t in times)
    ratio = forward_s / max(embed_s, 1e-9)
    return {"ratio": ratio, "embed_images_per_s": n / embed_s, "forward_images_per_s": n / forward_s,
            "images": n, "batch_size": bs,
            "detail": f"embed {n / embed_s:.0f} images/s, bare encode_image {n / forward_s:.0f} images/s "
                      f"({n} images, batch {bs}, float32; target >= 0.9)"}


def _timed(device: torch.device, work) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    work()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0
