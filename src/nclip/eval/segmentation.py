"""Protocol 10: zero-shot semantic segmentation of a GroupViT image tower (xCLIP App. D.2, Tab. 13,
following GroupViT, Xu et al. 2022, Sec. 3.3): mIoU and mAcc.

1. Groups to pixels. The tower's grouping stages each assign their input tokens to groups; the soft
   assignments are multiplied from the patches to the last stage's groups
   (:func:`nclip.models.groupvit_tower.patch_assignment`), upsampled bilinearly to the image, and each
   pixel goes to its arg-max group (GroupViT's hard assignment at inference).
2. Groups to classes, as GroupViT's ``encode_decode`` computes them. Each last-stage group token and
   the image's pooled feature (the mean of the group tokens, the tower's output) are projected by
   the CLIP head and scored against the class prompts: logits s · cos(·, class), s the model's
   logit scale. The image keeps the ``TOP_CLASSES`` (5) classes its pooled embedding ranks highest;
   a group's score for class c is softmax over those 5 (0 for the others) times the softmax over
   every class, and the group's class is its highest score.
3. Background, per image: a group whose best score is below min(``threshold``, the image's highest
   group score) is background, so the image's best group never is. The default 0.95 is GroupViT's
   own ``bg_thresh`` on PASCAL VOC; it is a setting (``nclip eval --segment-threshold``; 0: no
   background).
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

from nclip.data.transforms import EVAL_RESIZE, EvalPreprocess, eval_tensor, model_resize
from nclip.data.types import Sample
from nclip.defaults import EVAL_BATCH_SIZE
from nclip.errors import NclipError
from nclip.eval.masks import fit_mask

BACKGROUND_THRESHOLD = 0.95  # GroupViT's bg_thresh on PASCAL VOC
TOP_CLASSES = 5  # GroupViT's encode_decode: an image's groups choose among its pooled embedding's top 5 classes


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


def class_scores(group_emb: torch.Tensor, image_emb: torch.Tensor, class_emb: torch.Tensor, scale: float,
                 top: int = TOP_CLASSES) -> torch.Tensor:
    """group_emb [B, G, D], image_emb [B, D] (the pooled feature's), class_emb [C, D], all
    L2-normalised → float64 [B, G, C]: each group's score for each class, GroupViT's affinity
    (see the module docstring): the softmax over the image's ``top`` classes times the full softmax."""
    classes = class_emb.double().T
    logits = scale * group_emb.double() @ classes  # [B, G, C]
    image_p = (scale * image_emb.double() @ classes).softmax(dim=-1)  # [B, C]
    kept = torch.zeros_like(image_p, dtype=torch.bool)
    kept.scatter_(-1, image_p.topk(min(top, classes.shape[1]), dim=-1).indices, True)
    restricted = logits.masked_fill(~kept[:, None, :], float("-inf")).softmax(dim=-1)
    return restricted * logits.softmax(dim=-1)


def group_labels(group_emb: torch.Tensor, image_emb: torch.Tensor, class_emb: torch.Tensor, scale: float,
                 threshold: float = BACKGROUND_THRESHOLD) -> torch.Tensor:
    """long [B, G]: 0 (background) or 1 + the class of each group (:func:`class_scores`'s inputs),
    a group background when its best score is below min(``threshold``, the image's best group score)."""
    scores = class_scores(group_emb, image_emb, class_emb, scale)
    best = scores.amax(dim=-1)  # [B, G]
    cut = best.amax(dim=-1, keepdim=True).clamp(max=threshold)
    # GroupViT's class map: a background channel (1 where background, else 0) beside the class scores,
    # softmax over the channels (mmsegmentation's inference), arg-max. The softmax ties scores closer
    # than its precision's resolution (here float64's) and the first channel wins a tie: a group whose
    # scores are all ~0 (its classes outside the image's top 5) is background even at threshold 0
    channels = torch.cat([(best < cut).to(scores.dtype)[..., None], scores], dim=-1)
    return channels.softmax(dim=-1).argmax(dim=-1)


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


def truth_map(sample: Sample, size: int, classes: int, preprocess: EvalPreprocess = EVAL_RESIZE) -> np.ndarray:
    """long [size, size]: 1 + the class of each object mask's pixels, 0 elsewhere, in the eval view
    that ``preprocess`` gives the image; a class outside the ``classes`` segmented is a one-line error."""
    if sample.masks is None or sample.mask_classes is None:
        raise NclipError("zero-shot segmentation needs samples with classed object masks")
    out = np.zeros((size, size), dtype=np.int64)
    known = np.asarray(sample.mask_classes)
    if len(known) and not (known.min() >= 0 and known.max() < classes):
        raise NclipError(f"a mask holds class {int(np.max(sample.mask_classes)) + 1}, beyond the {classes} classes "
                         "segmented (PASCAL VOC's 20 for masks:DIR)")
    for mask, cls in zip(np.asarray(sample.masks), np.asarray(sample.mask_classes)):
        out[fit_mask(mask, size, preprocess)] = int(cls) + 1
    return out


@torch.no_grad()
def extract(model, samples: Sequence[Sample], image_size: int, device, classes: int,
            batch_size: int = EVAL_BATCH_SIZE) -> dict[str, torch.Tensor]:
    """{"groups": [N, G, h, w] soft assignments, "group_emb": [N, G, D] and "image_emb": [N, D]
    L2-normalised CLIP-head embeddings of the last groups and of the image's pooled feature,
    "truth": long [N, S, S] class maps (0 background), "ignore": bool [N, S, S] pixels left out of
    the scores (VOC's void; none for built-in scenes)}."""
    model.eval()
    preprocess = model_resize(model)  # the images' and their masks' geometry
    assigns, embs, images, truths, ignore = [], [], [], [], []
    for i in range(0, len(samples), batch_size):
        batch = [samples[j] for j in range(i, min(i + batch_size, len(samples)))]
        pixels = torch.stack([eval_tensor(s.image, image_size, preprocess) for s in batch]).to(device)
        tokens, assign = model.vision.groups(pixels)  # [B, G, width], [B, G, h, w]
        emb = model.project_image(tokens.flatten(0, 1))["clip"].unflatten(0, tokens.shape[:2])
        pooled = model.project_image(tokens.mean(dim=1))["clip"]  # the tower's output: the groups' mean
        embs.append(F.normalize(emb.float(), dim=-1).cpu())
        images.append(F.normalize(pooled.float(), dim=-1).cpu())
        assigns.append(assign.float().cpu())
        for s in batch:
            truths.append(truth_map(s, image_size, classes, preprocess))
            void = getattr(s, "ignore", None)
            ignore.append(np.zeros(truths[-1].shape, bool) if void is None
                          else fit_mask(np.asarray(void), image_size, preprocess))
    return {"groups": torch.cat(assigns), "group_emb": torch.cat(embs), "image_emb": torch.cat(images),
            "truth": torch.from_numpy(np.stack(truths)), "ignore": torch.from_numpy(np.stack(ignore))}


def evaluate(f: dict[str, torch.Tensor], class_emb: torch.Tensor, scale: float,
             threshold: float = BACKGROUND_THRESHOLD) -> dict:
    """The scores of :func:`extract`'s output against ``class_emb`` [C, D]: {"miou", "macc", "iou",
    "acc", "pred": long [N, S, S]}."""
    size = f["truth"].shape[-1]
    labels = group_labels(f["group_emb"], f["image_emb"], F.normalize(class_emb.float(), dim=-1), scale,
                          threshold)  # [N, G]
    pred = torch.gather(labels, 1, pixel_groups(f["groups"], size).flatten(1)).view_as(f["truth"])
    r = iou_and_accuracy(confusion(pred, f["truth"], len(class_emb) + 1, f.get("ignore")))
    return {**r, "pred": pred}
