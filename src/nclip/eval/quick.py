"""The end-of-training evaluation written to RUN/eval.json: zero-shot classification and retrieval
on held-out synthetic pairs (or digits), scored with the objective's zero-shot head.

A small, uncached subset of ``nclip eval`` (protocols 1 and 2 of :mod:`nclip.eval.zeroshot` and
:mod:`nclip.eval.retrieval`) on ``eval.samples`` held-out pairs; keys are ``zeroshot/<kind>/top1``,
``zeroshot/<kind>/chance`` and ``retrieval/{i2t,t2i}@{1,5}`` plus ``retrieval/mean_recall``.
"""

from __future__ import annotations

import torch

from nclip.config import RunConfig
from nclip.data.loader import build_dataset
from nclip.eval import retrieval, zeroshot
from nclip.eval.features import class_text_outputs, extract, similarity
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
        scores = zeroshot.scores(feats.image, class_text_outputs(model, space, device), head)
        m, _ = zeroshot.evaluate(scores, feats.labels[kind])
        results[f"zeroshot/{kind}/top1"] = m["top1"]
        results[f"zeroshot/{kind}/chance"] = m["chance"]
    sim = similarity(feats.image, feats.text, head)
    for k, v in retrieval.evaluate(sim, feats.text_to_image, ks=(1, 5)).items():
        results[f"retrieval/{k}"] = v
    return results
