"""OpenCLIP's training step over nclip's, for ``nclip bench --compare open_clip`` (only where
``open_clip`` is installed: nclip does not depend on it, and nothing is downloaded: the model is
built untrained).

OpenCLIP's side: ViT-B-16 at 224 px, its ``ClipLoss`` and ``torch.optim.AdamW``, under bf16
autocast on CUDA (float32 on the CPU), on one in-memory batch of random pixels and tokens at the
run's batch size, built once (:class:`OpenClipStep`). nclip's side: the trainer
(:func:`nclip.bench.loop_overhead.trainer_windows`) with the CLIP objective in its paper's defaults
on the run's model config (``--preset vit-b16-xclip``: the same ViT-B/16 towers and 512-d head as
OpenCLIP's), on one real batch of the run's data, in memory. One nclip run and one OpenCLIP model,
each built once; their windows alternate (nclip, OpenCLIP, ...). Ratio: nclip's samples/s over
OpenCLIP's, the median of the per-repeat ratios (target: ≥ 1.1, 10 % faster); wall time on a GPU,
process CPU time on the CPU, as the trainer row.
"""

from __future__ import annotations

import statistics

import torch

from nclip.bench.loop_overhead import Clock, device_of, one_batch, steps_for, timed_steps, trainer_windows


class OpenClipStep:
    """OpenCLIP's model, loss and optimizer, built once; :meth:`window` times ``steps`` steps."""

    def __init__(self, batch_size: int, device: torch.device, warmup: int = 3, model_name: str = "ViT-B-16"):
        import open_clip

        self.device, self.model_name = device, model_name
        self.model = open_clip.create_model(model_name, pretrained=None).to(device).train()
        self.loss_fn = open_clip.loss.ClipLoss()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.images = torch.randn(batch_size, 3, 224, 224, device=device)
        self.texts = torch.randint(1, 49407, (batch_size, 77), device=device)
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


def nclip_over_open_clip(clip_cfg, repeats: int, window_s: float, warmup: int = 3,
                         deadline: float = float("inf")) -> dict:
    """nclip's CLIP trainer step against OpenCLIP's ViT-B-16 step (module docstring); ``clip_cfg``:
    the run's config with the CLIP objective."""
    device = device_of(clip_cfg)
    clock = 0 if device.type == "cuda" else 1
    batch = one_batch(clip_cfg)
    theirs = OpenClipStep(clip_cfg.train.batch_size, device, warmup)
    steps = steps_for(theirs.pilot[0], window_s)
    open_clip: list[Clock] = []
    ours = trainer_windows(clip_cfg, batch, warmup, steps, repeats,
                           between=lambda: open_clip.append(theirs.window(steps)), deadline=deadline)
    b = clip_cfg.train.batch_size
    return {"ratio": statistics.median(o[clock] / n[clock] for n, o in zip(ours, open_clip)),
            "clock": ("wall", "cpu")[clock], "model": theirs.model_name, "batch_size": b,
            "nclip_samples_per_s": b / statistics.median(n[0] for n in ours),
            "open_clip_samples_per_s": b / statistics.median(o[0] for o in open_clip),
            "nclip_step_s": statistics.median(n[0] for n in ours),
            "open_clip_step_s": statistics.median(o[0] for o in open_clip),
            "steps": steps, "repeats": len(ours)}
