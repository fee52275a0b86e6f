"""OpenCLIP's training step over nclip's, for ``nclip bench --compare open_clip`` (only where
``open_clip`` is installed: nclip does not depend on it, and nothing is downloaded: the model is
built untrained).

Both sides train the same towers: OpenCLIP's ``CLIP`` is built from the run's model config
(:func:`open_clip_towers`: its ViT, its text transformer, the run's image size, text length and
vocabulary, a linear CLIP head of ``model.embed_dim``), so the ratio compares two implementations of one
model at any preset: at ``--preset vit-b16-xclip`` that is OpenCLIP's ViT-B-16, at ``micro`` a model
small enough for the CPU. A run whose towers open_clip cannot express (a conv-net image tower, a
pretrained text encoder, towers with different activations) skips the row saying why.

OpenCLIP's side: its ``CLIP``, ``ClipLoss`` and ``torch.optim.AdamW``, under bf16 autocast on CUDA
(float32 on the CPU), on one in-memory batch of random pixels and tokens of the run's shapes, built
once (:class:`OpenClipStep`). nclip's side: the trainer (:func:`nclip.bench.loop_overhead.trainer_windows`)
with the CLIP objective in its paper's defaults on the run's model config, on one real batch of the
run's data, in memory. One nclip run and one OpenCLIP model, each built once; their windows alternate
(nclip, OpenCLIP, ...). Ratio: nclip's samples/s over OpenCLIP's, the median of the per-repeat ratios
(target: ≥ 1.1, 10 % faster); wall time on a GPU, process CPU time on the CPU, as the trainer row.
"""

from __future__ import annotations

import statistics

import torch

from nclip.bench.loop_overhead import Clock, device_of, one_batch, steps_for, timed_steps, trainer_windows


def open_clip_towers(cfg) -> dict | str:
    """open_clip's ``CLIP(**config)`` for the towers of the run ``cfg`` with a linear CLIP head, or why
    open_clip cannot express them (one line)."""
    from nclip.data.tokenization import CaptionTokenizer
    from nclip.models.export_openclip import text_cfg, vit_cfg

    m = cfg.model
    if m.vision.kind != "vit":
        return f"open_clip cannot express the run's image tower {m.vision.kind!r} here (a ViT is compared)"
    if m.text.kind != "transformer":
        return f"open_clip cannot express the run's text tower {m.text.kind!r} (a CLIP-style transformer is compared)"
    if m.vision.hidden_act != m.text.hidden_act:
        return (f"the run's towers use different activations ({m.vision.hidden_act}, {m.text.hidden_act}); "
                "open_clip has one quick_gelu switch for both")
    if m.vision.hidden_act == "gelu_pytorch_tanh":
        return "open_clip's CLIP has no tanh-approximated GELU (the run's hidden_act)"
    vocab = CaptionTokenizer(cfg.data.text_length, m.text.tokenizer).vocab_size
    return {"embed_dim": m.embed_dim, "vision_cfg": vit_cfg(cfg), "text_cfg": text_cfg(cfg, vocab),
            "quick_gelu": m.vision.hidden_act == "quick_gelu"}


class OpenClipStep:
    """OpenCLIP's model (``CLIP(**towers)``), loss and optimizer, built once; :meth:`window` times
    ``steps`` steps."""

    def __init__(self, towers: dict, batch_size: int, device: torch.device, warmup: int = 3):
        import open_clip

        self.device = device
        self.model = open_clip.model.CLIP(**towers).to(device).train()
        self.loss_fn = open_clip.loss.ClipLoss()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        size, text = towers["vision_cfg"]["image_size"], towers["text_cfg"]
        self.images = torch.randn(batch_size, 3, size, size, device=device)
        self.texts = torch.randint(1, text["vocab_size"], (batch_size, text["context_length"]), device=device)
        self.pilot = self.window(max(warmup, 1))

    def step(self) -> None:
        cuda = self.device.type == "cuda"
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=cuda):
            img, txt, scale = self.model(self.images, self.texts)[:3]
        self.loss_fn(img.float(), txt.float(), scale.float()).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def window(self, steps: int) -> Clock:
        return timed_steps(self.step, self.device, steps)


def nclip_over_open_clip(clip_cfg, towers: dict, repeats: int, window_s: float, warmup: int = 3,
                         deadline: float = float("inf")) -> dict:
    """nclip's CLIP trainer step against OpenCLIP's step on the same towers (module docstring);
    ``clip_cfg``: the run's config with the CLIP objective, ``towers``: :func:`open_clip_towers` of it."""
    device = device_of(clip_cfg)
    clock = 0 if device.type == "cuda" else 1
    batch = one_batch(clip_cfg)
    theirs = OpenClipStep(towers, clip_cfg.train.batch_size, device, warmup)
    steps = steps_for(theirs.pilot[0], window_s)
    open_clip: list[Clock] = []
    ours = trainer_windows(clip_cfg, batch, warmup, steps, repeats,
                           between=lambda: open_clip.append(theirs.window(steps)), deadline=deadline)
    b = clip_cfg.train.batch_size
    return {"ratio": statistics.median(o[clock] / n[clock] for n, o in zip(ours, open_clip)),
            "clock": ("wall", "cpu")[clock], "batch_size": b,
            "nclip_samples_per_s": b / statistics.median(n[0] for n in ours),
            "open_clip_samples_per_s": b / statistics.median(o[0] for o in open_clip),
            "nclip_step_s": statistics.median(n[0] for n in ours),
            "open_clip_step_s": statistics.median(o[0] for o in open_clip),
            "steps": steps, "repeats": len(ours)}
