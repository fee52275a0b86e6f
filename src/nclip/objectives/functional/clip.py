"""CLIP: symmetric InfoNCE (xCLIP paper Eq. 1).

The paper joins the two directions two ways: Sec. 3.1's prose takes "the average of two terms", its
Algorithm 1 returns INCE(U_IᵀU_T/σ) + INCE(U_TᵀU_I/σ), the sum, while L_nCLIP beside it returns L/2.
Under Eq. 5 the readings weigh L_CLIP by a factor 2 apart (λ_CLIP = 0.2 with the sum is λ_CLIP = 0.4
with the mean). ``reduction`` picks one (``objective.clip_reduction``); ``"mean"`` is the default.

With several captions per image (``data.caption_choice: all``), every caption is a positive of its
image: the image's target is uniform over its captions, a caption's its one image.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nclip.objectives.functional._common import check_pair, global_rows, pair_logit_stats

# --------------------------------------------------------------------------------------------
# CLIP: symmetric InfoNCE, Eq. (1)
# --------------------------------------------------------------------------------------------

# how L_CLIP joins its two InfoNCE directions: "mean" (Sec. 3.1's prose), "sum" (Algorithm 1)
CLIP_REDUCTIONS = ("mean", "sum")


def check_clip_reduction(reduction: str) -> None:
    if reduction not in CLIP_REDUCTIONS:
        raise ValueError(f"clip reduction {reduction!r} is not one of {', '.join(CLIP_REDUCTIONS)}")


def clip_terms(
    image_emb: torch.Tensor,
    text_emb: torch.Tensor,
    logit_scale: torch.Tensor | float,
    *,
    global_batch: bool = True,
    reduction: str = "mean",
    caption_valid: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Symmetric InfoNCE (Eq. 1, Algorithm 1's L_CLIP) with diagnostics.

    Args:
        image_emb: [B, D] projected image features g_I (normalised inside).
        text_emb: [B, D] projected text features g_T (normalised inside); or [B, C, D], C caption
            slots per image, each caption a positive of its image (:func:`_several_captions`).
        logit_scale: scalar multiplier 1/σ, already exponentiated.
        global_batch: use all ranks' rows as negatives when running distributed.
        reduction: ``"mean"`` of the two directions (Sec. 3.1) or their ``"sum"`` (Algorithm 1).
        caption_valid: with text_emb [B, C, D], [B, C] bool: which slots hold a caption.

    Returns a dict with ``loss`` = INCE(U_IᵀU_T/σ) + INCE(U_TᵀU_I/σ), divided by 2 under
    ``"mean"`` (L_CLIP as it enters Eq. 5, before λ_CLIP), and detached diagnostics: ``acc_i2t``,
    ``acc_t2i`` (Acc_C of Tab. B2, the share of rows whose paired sample has the highest logit),
    ``logit_pos`` and ``logit_neg`` (mean positive and negative logits).
    """
    if text_emb.ndim == 3:
        return _several_captions(image_emb, text_emb, caption_valid, logit_scale, global_batch, reduction)
    check_pair(image_emb, text_emb, "image_emb", "text_emb")
    check_clip_reduction(reduction)
    u_i = F.normalize(image_emb, dim=-1)  # [B, D]
    u_t = F.normalize(text_emb, dim=-1)  # [B, D]
    batch = u_i.shape[0]
    (all_i, all_t), offset = global_rows(u_i, u_t, global_batch=global_batch)  # [W·B, D]
    targets = torch.arange(offset, offset + batch, device=u_i.device)
    logits_i2t = logit_scale * u_i @ all_t.T  # [B, W·B]: local images against every text
    logits_t2i = logit_scale * u_t @ all_i.T  # [B, W·B]: local texts against every image
    loss = F.cross_entropy(logits_i2t, targets) + F.cross_entropy(logits_t2i, targets)
    if reduction == "mean":
        loss = loss / 2
    terms = pair_logit_stats(logits_i2t, targets)
    with torch.no_grad():
        terms["acc_t2i"] = (logits_t2i.argmax(1) == targets).float().mean()
    return {"loss": loss, **terms}


def _several_captions(image_emb: torch.Tensor, text_emb: torch.Tensor, caption_valid: torch.Tensor | None,
                      logit_scale: torch.Tensor | float, global_batch: bool, reduction: str) -> dict[str, torch.Tensor]:
    """:func:`clip_terms` with several captions per image, every one a positive of its image
    (``data.caption_choice: all``); with one caption per image it is the plain InfoNCE.

    image_emb [B, D]; text_emb [B, C, D], each image's C caption slots; caption_valid [B, C] bool, which
    slots hold a caption (every image has at least one): the others are padding, neither positives nor
    negatives.

    Image → text: image i scores every caption of the (global) batch, and its target is uniform over its
    own P_i captions: ℓ_i = −(1/|P_i|) Σ_{j∈P_i} log softmax_j(s_i·). Text → image: caption j scores every
    image, its target its one image. The loss is the mean of ℓ_i over the images joined with the mean
    of the captions' cross-entropies over the captions (their mean or sum, ``reduction``). Distributed,
    a rank's caption term is its captions' sum times W over the global caption count, so the mean over
    ranks is the loss of the whole batch, as :func:`clip_terms`'s is.

    Returns ``loss`` and detached diagnostics: ``acc_i2t`` (an image's best caption is one of its own),
    ``acc_t2i`` (a caption's best image is its own), ``logit_pos`` and ``logit_neg`` (mean logits of the
    image–caption pairs that match and of those that do not).
    """
    if caption_valid is None or image_emb.ndim != 2 or text_emb.shape[0] != image_emb.shape[0] \
            or text_emb.shape[2] != image_emb.shape[1] or caption_valid.shape != text_emb.shape[:2]:
        got = None if caption_valid is None else tuple(caption_valid.shape)
        raise ValueError(f"image_emb [B, D], text_emb [B, C, D] and caption_valid [B, C] expected, got "
                         f"{tuple(image_emb.shape)}, {tuple(text_emb.shape)} and {got}")
    check_clip_reduction(reduction)
    batch, slots = text_emb.shape[:2]
    valid = caption_valid.to(device=image_emb.device, dtype=torch.bool)
    u_i = F.normalize(image_emb, dim=-1)  # [B, D]
    u_t = F.normalize(text_emb, dim=-1)  # [B, C, D]
    (all_i, all_t, all_valid), offset = global_rows(u_i, u_t, valid.to(u_i.dtype), global_batch=global_batch)
    all_valid = all_valid > 0  # [W·B, C]
    # image → text: local images against every caption slot, the padding ones at −∞
    logits_i2t = logit_scale * u_i @ all_t.flatten(0, 1).T  # [B, W·B·C]
    logits_i2t = logits_i2t.masked_fill(~all_valid.flatten()[None, :], float("-inf"))
    rows = offset + torch.arange(batch, device=u_i.device)  # the local images' rows in the global batch
    own = rows[:, None] * slots + torch.arange(slots, device=u_i.device)[None, :]  # [B, C]: their caption slots
    log_p = F.log_softmax(logits_i2t, dim=1).gather(1, own).masked_fill(~valid, 0.0)  # [B, C]
    loss_i2t = (-log_p.sum(1) / valid.sum(1)).mean()
    # text → image: local caption slots against every image, the padding slots left out
    logits_t2i = logit_scale * u_t.flatten(0, 1) @ all_i.T  # [B·C, W·B]
    owner = rows.repeat_interleave(slots)  # [B·C]: each slot's image
    ce = F.cross_entropy(logits_t2i, owner, reduction="none").masked_fill(~valid.flatten(), 0.0)
    loss_t2i = ce.sum() * (all_i.shape[0] / batch) / all_valid.sum()  # W · (local sum) / global count
    loss = loss_i2t + loss_t2i
    if reduction == "mean":
        loss = loss / 2
    with torch.no_grad():  # masked sums, not boolean indexing: nothing here waits on the device
        acc_i2t = (logits_i2t.argmax(1) // slots == rows).float().mean()
        flat_valid = valid.flatten()
        acc_t2i = ((logits_t2i.argmax(1) == owner) & flat_valid).sum() / flat_valid.sum()
        matched = torch.zeros_like(logits_i2t, dtype=torch.bool).scatter_(1, own, valid)  # [B, W·B·C]
        negatives = all_valid.flatten()[None, :] & ~matched
        logit_pos = torch.where(matched, logits_i2t, 0.0).sum() / matched.sum()
        logit_neg = torch.where(negatives, logits_i2t, 0.0).sum() / negatives.sum().clamp(min=1)
    return {"loss": loss, "acc_i2t": acc_i2t, "acc_t2i": acc_t2i, "logit_pos": logit_pos, "logit_neg": logit_neg}
