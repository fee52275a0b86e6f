"""The end-of-training evaluation written to RUN/eval.json: zero-shot classification and retrieval
on held-out synthetic pairs (or digits), scored with the objective's zero-shot head."""

from __future__ import annotations

import torch

from nclip.config import RunConfig
from nclip.data.loader import build_dataset
from nclip.eval.features import class_text_outputs, extract, similarity
from nclip.eval.metrics import recall_at_k, topk_accuracy
from nclip.objectives import REGISTRY


@torch.no_grad()
def evaluate_run(model, cfg: RunConfig, device) -> dict[str, float]:
    head = REGISTRY[cfg.objective.name][1].zero_shot_head
    split = "test"
    data = build_dataset(cfg, split, length=cfg.eval.samples)
    feats = extract(model, data, cfg.data.image_size, device, cfg.eval.batch_size)
    results: dict[str, float] = {"eval/samples": float(len(data)), "eval/head": head}
    for kind, space in data.label_spaces.items():
        if kind not in feats.labels:
            continue
        scores = similarity(feats.image, class_text_outputs(model, space, device), head)
        acc = topk_accuracy(scores, feats.labels[kind], ks=(1,))
        results[f"zeroshot/{kind}/top1"] = acc["top1"]
        results[f"zeroshot/{kind}/chance"] = 1.0 / len(space)
    sim = similarity(feats.image, feats.text, head)
    for k, v in recall_at_k(sim, feats.text_to_image, ks=(1, 5)).items():
        results[f"retrieval/{k}"] = v
    return results
