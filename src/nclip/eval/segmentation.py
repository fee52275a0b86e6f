"""Protocol 10: zero-shot semantic segmentation of a GroupViT image tower (xCLIP App. D.2, Tab. 13,
following GroupViT, Xu et al. 2022, Sec. 3.3): mIoU and mAcc.

1. Groups to pixels. The tower's grouping stages each assign their input tokens to groups; the soft
   assignments are multiplied from the patches to the last stage's groups
   (:func:`nclip.models.groupvit_tower.patch_assignment`), upsampled bilinearly to the image, and each
   pixel goes to its arg-max group (GroupViT's hard assignment at inference).
2. Groups to classes. Each last-stage group token is projected like the image embedding (the CLIP
   head) and classified zero-shot against the class prompts: p = softmax(s · cos(group, class)), s the
   model's logit scale.
3. Background. A group whose best class has p below ``threshold`` is background. The default, 0.95,
   is GroupViT's own on PASCAL VOC (its ``bg_thresh``, on the same softmax); it is a setting
   (``nclip eval --segment-threshold``).
4. Scores, over the whole test set (one confusion matrix of background + the classes, void pixels
   left out): IoU_c = TP / (TP + FP + FN) and Acc_c = TP / (TP + FN); mIoU averages IoU over the
   classes that occur in the truth or the prediction, mAcc averages Acc over the classes in the
   truth (mmsegmentation's convention, which GroupViT reports).

On the synthetic scenes the classes are the shapes (each object mask's shape, background elsewhere);
on ``masks:DIR`` (:mod:`nclip.eval.mask_folder`) PASCAL VOC's 20 classes, VOC's void pixels left out.
Towers other than GroupViT have no grouping: :func:`unsupported` says so and the runner skips the task.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from nclip.data.transforms import eval_tensor
from nclip.data.types import Sample
from nclip.defaults import EVAL_BATCH_SIZE
from nclip.errors import NclipError
from nclip.eval.masks import fit_mask

BACKGROUND_THRESHOLD = 0.95  # GroupViT's bg_thresh on PASCAL VOC


def unsupported(vision_kind: str, heads: frozenset[str]) -> str | None:
    """Why a model cannot be evaluated here (one line), or None if it can."""
    if vision_kind != "groupvit":
        return f"the {vision_kind} image tower has no grouping to segment with (needs model.vision.kind groupvit)"
    if "clip" not in heads:
        return "zero-shot segmentation classifies groups with the CLIP head, which this model has not"
    return None


def pixel_groups(assign: torch.Tensor, size: int) -> torch.Tensor:
    """assign [B, G, h, w] (the patches' soft assignment to the groups) → long [B, size, size]: each
    pixel's arg-max group after bilinear upsampling (as transformers' ``resize_attention_map``)."""
    up = F.interpolate(assign.float(), size=(size, size), mode="bilinear", align_corners=False)
    return up.argmax(dim=1)


def group_labels(group_emb: torch.Tensor, class_emb: torch.Tensor, scale: float,
                 threshold: float = BACKGROUND_THRESHOLD) -> torch.Tensor:
    """group_emb [B, G, D], class_emb [C, D] (both L2-normalised) → long [B, G]: 1 + the group's
    zero-shot class, or 0 (background) where its best class probability is below ``threshold``."""
    p = (scale * group_emb.float() @ class_emb.float().T).softmax(dim=-1)  # [B, G, C]
    best, cls = p.max(dim=-1)
    return torch.where(best >= threshold, cls + 1, torch.zeros_like(cls))


def confusion(pred: torch.Tensor, truth: torch.Tensor, classes: int,
              ignore: torch.Tensor | None = None) -> torch.Tensor:
    """pred, truth long [N, S, S] in [0, classes) → [classes, classes] pixel counts (row: truth,
    column: prediction); ``ignore`` bool [N, S, S] pixels are left out."""
    keep = torch.ones_like(truth, dtype=torch.bool) if ignore is None else ~ignore
    idx = truth[keep] * classes + pred[keep]
    return torch.bincount(idx, minlength=classes * classes).reshape(classes, classes)


def iou_and_accuracy(conf: torch.Tensor) -> dict:
    """{"miou", "macc", "iou": [K] (NaN: class in neither), "acc": [K] (NaN: class not in the truth)}
    from a confusion matrix (see the module docstring)."""
    conf = conf.double()
    tp = conf.diag()
    truth, pred = conf.sum(1), conf.sum(0)
    union = truth + pred - tp
    iou = torch.where(union > 0, tp / union.clamp_min(1), torch.full_like(tp, float("nan")))
    acc = torch.where(truth > 0, tp / truth.clamp_min(1), torch.full_like(tp, float("nan")))
    return {"miou": float(iou.nanmean()), "macc": float(acc.nanmean()), "iou": iou, "acc": acc}


def truth_map(sample: Sample, size: int, classes: int) -> np.ndarray:
    """long [size, size]: 1 + the class of each object mask's pixels, 0 elsewhere, in the eval view;
    a class outside the ``classes`` segmented is a one-line error."""
    if sample.masks is None or sample.mask_classes is None:
        raise NclipError("zero-shot segmentation needs samples with classed object masks")
    out = np.zeros((size, size), dtype=np.int64)
    known = np.asarray(sample.mask_classes)
    if len(known) and not (known.min() >= 0 and known.max() < classes):
        raise NclipError(f"a mask holds class {int(np.max(sample.mask_classes)) + 1}, beyond the {classes} classes "
                         "segmented (PASCAL VOC's 20 for masks:DIR)")
    for mask, cls in zip(np.asarray(sample.masks), np.asarray(sample.mask_classes)):
        out[fit_mask(mask, size)] = int(cls) + 1
    return out


@torch.no_grad()
def extract(model, samples: Sequence[Sample], image_size: int, device, classes: int,
            batch_size: int = EVAL_BATCH_SIZE) -> dict[str, torch.Tensor]:
    """{"groups": [N, G, h, w] soft assignments, "group_emb": [N, G, D] L2-normalised CLIP-head
    embeddings of the last groups, "truth": long [N, S, S] class maps (0 background), "ignore": bool
    [N, S, S] pixels left out of the scores (VOC's void; none for built-in scenes)}."""
    model.eval()
    assigns, embs, truths, ignore = [], [], [], []
    for i in range(0, len(samples), batch_size):
        batch = [samples[j] for j in range(i, min(i + batch_size, len(samples)))]
        pixels = torch.stack([eval_tensor(s.image, image_size) for s in batch]).to(device)
        tokens, assign = model.vision.groups(pixels)  # [B, G, width], [B, G, h, w]
        emb = model.project_image(tokens.flatten(0, 1))["clip"].unflatten(0, tokens.shape[:2])
        embs.append(F.normalize(emb.float(), dim=-1).cpu())
        assigns.append(assign.float().cpu())
        for s in batch:
            truths.append(truth_map(s, image_size, classes))
            void = getattr(s, "ignore", None)
            ignore.append(np.zeros(truths[-1].shape, bool) if void is None else fit_mask(np.asarray(void), image_size))
    return {"groups": torch.cat(assigns), "group_emb": torch.cat(embs),
            "truth": torch.from_numpy(np.stack(truths)), "ignore": torch.from_numpy(np.stack(ignore))}


def evaluate(f: dict[str, torch.Tensor], class_emb: torch.Tensor, scale: float,
             threshold: float = BACKGROUND_THRESHOLD) -> dict:
    """The scores of :func:`extract`'s output against ``class_emb`` [C, D]: {"miou", "macc", "iou",
    "acc", "pred": long [N, S, S]}."""
    size = f["truth"].shape[-1]
    labels = group_labels(f["group_emb"], F.normalize(class_emb.float(), dim=-1), scale, threshold)  # [N, G]
    pred = torch.gather(labels, 1, pixel_groups(f["groups"], size).flatten(1)).view_as(f["truth"])
    r = iou_and_accuracy(confusion(pred, f["truth"], len(class_emb) + 1, f.get("ignore")))
    return {**r, "pred": pred}
