"""The end-of-training evaluation written to RUN/eval.json: zero-shot classification and retrieval
on held-out synthetic pairs (or digits), scored with the objective's zero-shot score (the plan's
``zero_shot``, with the run's ``eval.nclip_score``).

A small, uncached subset of ``nclip eval`` (protocols 1 and 2 of :mod:`nclip.eval.zeroshot` and
:mod:`nclip.eval.retrieval`) on ``eval.samples`` held-out pairs; keys are ``zeroshot/<kind>/top1``,
``zeroshot/<kind>/chance`` and ``retrieval/{i2t,t2i}@{1,5}`` plus ``retrieval/mean_recall``.

An objective without a text-aligned head (``zero_shot = None``: CMSF, the cross-entropy
baseline) is scored instead by the probes of :mod:`nclip.eval.probe` (protocols 4 and 5): weighted
k-NN and the L-BFGS linear probe, trained on ``eval.samples`` training images (digits: the whole
train split) and tested on ``eval.samples`` held-out ones, against the *clean* labels of the run's
label kind: ``knn/<kind>/top1``, ``linear/<kind>/top1``, ``probe/<kind>/chance``. They read the
image features ``eval.probe_features`` names (None: the objective's ``probe_features``, the
backbone for CMSF and xent), recorded as ``eval/probe_features``, as ``nclip eval --features``.

The towers encode under the run's autocast (``train.precision``: bf16 on CUDA by default) and every
score is computed in float32 (:mod:`nclip.eval.features`).
"""

from __future__ import annotations

import torch

from nclip.config import RunConfig
from nclip.data.sources import MAIN_LABEL, build_dataset
from nclip.eval import probe, retrieval, zeroshot
from nclip.eval.features import class_text_outputs, extract, similarity
from nclip.heads import probe_output
from nclip.objectives import plan_for
from nclip.objectives.base import LabelRequest
from nclip.precision import autocast_dtype


@torch.no_grad()
def evaluate_run(model, cfg: RunConfig, device) -> dict[str, float]:
    objective = plan_for(cfg)
    score = objective.zero_shot
    split = "test"
    data = build_dataset(cfg, split, length=cfg.eval.samples)
    amp = autocast_dtype(cfg.train.precision, torch.device(device))  # the towers' precision in training
    if score is None:
        return _probe_run(model, cfg, device, data, objective, amp)
    feats = extract(model, data, cfg.data.image_size, device, cfg.eval.batch_size, autocast=amp)
    results: dict = {"eval/samples": float(len(data)), "eval/head": score.name}
    results.update({f"eval/{option}": value for option, value in score.options().items()})  # nCLIP's direction
    for kind, space in data.label_kinds.items():
        if kind not in feats.labels:
            continue
        scores = zeroshot.scores(feats.image, class_text_outputs(model, space, device, score, amp), score)
        m, _ = zeroshot.evaluate(scores, feats.labels[kind])
        results[f"zeroshot/{kind}/top1"] = m["top1"]
        results[f"zeroshot/{kind}/chance"] = m["chance"]
    sim = similarity(feats.image, feats.text, score)
    for k, v in retrieval.evaluate(sim, feats.text_to_image, ks=(1, 5)).items():
        results[f"retrieval/{k}"] = v
    return results


def _probe_run(model, cfg: RunConfig, device, test_data, objective, amp: torch.dtype | None) -> dict:
    """k-NN and linear-probe top-1 on the probed features, for objectives without a zero-shot head."""
    from nclip.eval.runner import probe_features

    features = probe_features(cfg.eval.probe_features, cfg.objective)
    key = probe_output(features)
    kind = (objective.label_request() or LabelRequest()).key or MAIN_LABEL[cfg.data.source]
    # the probe's training images come from the training split (synthetic: its first eval.samples
    # scenes), its test images from the held-out split, as nclip eval's linear and k-NN protocols
    train_data = build_dataset(cfg, "train", length=cfg.eval.samples)
    bs = cfg.eval.batch_size
    train, test = (extract(model, d, cfg.data.image_size, device, bs, texts=False, autocast=amp)
                   for d in (train_data, test_data))
    n_cls = len(test_data.label_kinds[kind])
    xtr, ytr = train.image[key], train.labels[kind]
    xte, yte = test.image[key], test.labels[kind]
    results: dict = {"eval/samples": float(len(test_data)), "eval/train_samples": float(len(train_data)),
                     "eval/head": "features", "eval/label": kind, "eval/probe_features": features}
    results[f"knn/{kind}/top1"] = probe.knn(xtr, ytr, xte, yte, n_cls)["top1"]
    results[f"linear/{kind}/top1"] = probe.linear(xtr, ytr, xte, yte, n_cls, seed=cfg.seed)["top1"]
    results[f"probe/{kind}/chance"] = float(torch.bincount(yte, minlength=n_cls).max()) / len(yte)
    return results
