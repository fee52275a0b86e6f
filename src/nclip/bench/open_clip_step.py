"""OpenCLIP's training step, for ``nclip bench --compare open_clip`` (only where ``open_clip`` is
installed: nclip does not depend on it, and nothing is downloaded: the model is built untrained).

One step: ViT-B-16 at 224 px on random pixels and tokens, open_clip's ``ClipLoss``, AdamW, under
bf16 autocast on CUDA, at the run's batch size; seconds per step, median of the timed steps.
"""

from __future__ import annotations

import statistics
import time

import torch


def open_clip_step_s(cfg, steps: int = 10, warmup: int = 3, model_name: str = "ViT-B-16") -> float:
    import open_clip

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = open_clip.create_model(model_name, pretrained=None).to(device).train()
    loss_fn = open_clip.loss.ClipLoss()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    b = cfg.train.batch_size
    images = torch.randn(b, 3, 224, 224, device=device)
    texts = torch.randint(1, 49407, (b, 77), device=device)
    times = []
    for i in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            img, txt, scale = model(images, texts)[:3]
        loss_fn(img.float(), txt.float(), scale.float()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
