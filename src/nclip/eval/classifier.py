"""The pre-training classifier's readout, ``nclip eval --tasks classifier``: CMSF's Tab. 1 scores
FrzProto and Xent with "the classifier trained during pre-training" (Sec. 2.1.3), not a probe of
the backbone. Xent's classifier is its linear layer (the model's "xent" head); FrzProto's is
the nearest frozen prototype, argmax_c cos(z, p_c) of the "supcon" head's output z against the
seeded prototypes the objective trained with (re-drawn here from the run's seed, class count and
``model.supcon_dim``: the same :func:`functional.frozen_prototypes` call as the objective's build).
Reported as ``classifier/<dataset>-<kind>/top1`` for the label kinds with as many classes as the
classifier (the training labels' space)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

OBJECTIVES = ("xent", "frzproto")


def class_scores(image: dict[str, torch.Tensor], cfg) -> torch.Tensor | str:
    """[N, C] scores of the pre-training classifier on the extracted image outputs, or the
    one-line reason this checkpoint has none."""
    name = cfg.objective.name
    if name == "xent" and "xent" in image:
        return image["xent"].float()
    if name == "frzproto" and "supcon" in image:
        from nclip.data.labels import run_label_space
        from nclip.objectives import functional
        from nclip.objectives.base import class_count

        k = class_count(cfg.objective, run_label_space(cfg))
        prototypes = functional.frozen_prototypes(k, cfg.model.supcon_dim, cfg.seed)  # [C, D]
        return F.normalize(image["supcon"].float(), dim=-1) @ prototypes.T
    if name in OBJECTIVES:  # a feature cache written before the readout existed lacks the output
        return f"the cached features of this {name} checkpoint lack its classifier's input: rerun with a new cache"
    return (f"objective {name} learns no classifier in pre-training (the readout covers "
            f"{', '.join(OBJECTIVES)})")


def top1(scores: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Top-1 accuracy of argmax over the classes; labels < 0 (unlabelled) are left out."""
    keep = labels >= 0
    return {"top1": float((scores[keep].argmax(-1) == labels[keep]).float().mean())}
