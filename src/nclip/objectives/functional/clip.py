"""CLIP: symmetric InfoNCE (xCLIP paper Eq. 1).

The paper joins the two directions two ways: Sec. 3.1's prose takes "the average of two terms", its
Algorithm 1 returns INCE(U_IᵀU_T/σ) + INCE(U_TᵀU_I/σ), the sum, while L_nCLIP beside it returns L/2.
Under Eq. 5 the readings weigh L_CLIP by a factor 2 apart (λ_CLIP = 0.2 with the sum is λ_CLIP = 0.4
with the mean). ``reduction`` picks one (``objective.clip_reduction``); ``"mean"`` is the default.

With several captions per image (``data.caption_choice: all``), every caption is a positive of its
image: the image's target is uniform over its captions, a caption's its one image.

Hard negative captions (NegCLIP, Yuksekgonul et al. 2023, ``data.hard_negative_key`` or
``data.hard_negatives``): every image's negatives join the text candidates of the image → text
direction, for every image of the (global) batch, as NegCLIP appends them to the batch's texts; the
text → image direction is unchanged (a negative has no image to predict).
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
    negatives: torch.Tensor | None = None,
    negative_valid: torch.Tensor | None = None,
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
        negatives: [B, N, D] hard negative captions, N slots per image (normalised inside), with
            negative_valid [B, N] bool: which slots hold one. Each is one more text candidate of
            every image's image → text softmax (NegCLIP); None: none.

    Returns a dict with ``loss`` = INCE(U_IᵀU_T/σ) + INCE(U_TᵀU_I/σ), divided by 2 under
    ``"mean"`` (L_CLIP as it enters Eq. 5, before λ_CLIP), and detached diagnostics: ``acc_i2t``,
    ``acc_t2i`` (Acc_C of Tab. B2, the share of rows whose paired sample has the highest logit),
    ``logit_pos`` and ``logit_neg`` (mean positive and negative logits); with negatives ``acc_i2t``
    counts them among the candidates, and ``acc_hard`` is the share of images whose caption scores
    above every one of their own negatives (SugarCrepe's accuracy on the training batch).
    """
    if negatives is not None:
        _check_negatives(image_emb, negatives, negative_valid)
    if text_emb.ndim == 3:
        return _several_captions(image_emb, text_emb, caption_valid, logit_scale, global_batch, reduction,
                                 negatives, negative_valid)
    check_pair(image_emb, text_emb, "image_emb", "text_emb")
    check_clip_reduction(reduction)
    u_i = F.normalize(image_emb, dim=-1)  # [B, D]
    u_t = F.normalize(text_emb, dim=-1)  # [B, D]
    batch = u_i.shape[0]
    if negatives is None:
        (all_i, all_t), offset = global_rows(u_i, u_t, global_batch=global_batch)  # [W·B, D]
    else:
        u_n, n_valid = F.normalize(negatives, dim=-1), negative_valid.to(device=u_i.device, dtype=u_i.dtype)
        (all_i, all_t, all_n, all_n_valid), offset = global_rows(u_i, u_t, u_n, n_valid, global_batch=global_batch)
    targets = torch.arange(offset, offset + batch, device=u_i.device)
    logits_i2t = logit_scale * u_i @ all_t.T  # [B, W·B]: local images against every text
    logits_t2i = logit_scale * u_t @ all_i.T  # [B, W·B]: local texts against every image
    if negatives is None:
        loss = F.cross_entropy(logits_i2t, targets) + F.cross_entropy(logits_t2i, targets)
    else:
        hard = _negative_logits(u_i, all_n, all_n_valid, logit_scale)  # [B, W·B·N]
        loss = F.cross_entropy(torch.cat([logits_i2t, hard], 1), targets) + F.cross_entropy(logits_t2i, targets)
    if reduction == "mean":
        loss = loss / 2
    terms = pair_logit_stats(logits_i2t, targets)
    with torch.no_grad():
        terms["acc_t2i"] = (logits_t2i.argmax(1) == targets).float().mean()
        if negatives is not None:
            pos = logits_i2t.gather(1, targets[:, None]).squeeze(1)
            terms["acc_i2t"] = (pos >= torch.cat([logits_i2t, hard], 1).max(1).values).float().mean()
            terms["acc_hard"] = _hard_accuracy(pos, u_i, u_n, negative_valid, logit_scale)
    return {"loss": loss, **terms}


def _check_negatives(image_emb: torch.Tensor, negatives: torch.Tensor, negative_valid: torch.Tensor | None) -> None:
    if negative_valid is None or negatives.ndim != 3 or negatives.shape[0] != image_emb.shape[0] \
            or negatives.shape[2] != image_emb.shape[-1] or negative_valid.shape != negatives.shape[:2]:
        got = None if negative_valid is None else tuple(negative_valid.shape)
        raise ValueError(f"negatives [B, N, D] and negative_valid [B, N] expected beside image_emb "
                         f"{tuple(image_emb.shape)}, got {tuple(negatives.shape)} and {got}")


def _negative_logits(u_i: torch.Tensor, all_n: torch.Tensor, all_n_valid: torch.Tensor,
                     logit_scale: torch.Tensor | float) -> torch.Tensor:
    """The local images against every (gathered) hard negative slot [B, W·B·N], the empty slots at −∞
    (out of every softmax)."""
    logits = logit_scale * u_i @ all_n.flatten(0, 1).T
    return logits.masked_fill(~(all_n_valid > 0).flatten()[None, :], float("-inf"))


@torch.no_grad()
def _hard_accuracy(pos: torch.Tensor, u_i: torch.Tensor, u_n: torch.Tensor, negative_valid: torch.Tensor,
                   logit_scale: torch.Tensor | float) -> torch.Tensor:
    """The share of images whose caption logit ``pos`` [B] is above every one of their own negatives'."""
    own = (logit_scale * (u_i[:, None, :] * u_n).sum(-1)).masked_fill(~negative_valid.to(torch.bool), float("-inf"))
    return (pos > own.max(1).values).float().mean()


def _several_captions(image_emb: torch.Tensor, text_emb: torch.Tensor, caption_valid: torch.Tensor | None,
                      logit_scale: torch.Tensor | float, global_batch: bool, reduction: str,
                      negatives: torch.Tensor | None = None,
                      negative_valid: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
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
    extra = () if negatives is None else (F.normalize(negatives, dim=-1), negative_valid.to(device=u_i.device,
                                                                                              dtype=u_i.dtype))
    (all_i, all_t, all_valid, *all_neg), offset = global_rows(u_i, u_t, valid.to(u_i.dtype), *extra,
                                                              global_batch=global_batch)
    all_valid = all_valid > 0  # [W·B, C]
    # image → text: local images against every caption slot, the padding ones at −∞
    logits_i2t = logit_scale * u_i @ all_t.flatten(0, 1).T  # [B, W·B·C]
    logits_i2t = logits_i2t.masked_fill(~all_valid.flatten()[None, :], float("-inf"))
    rows = offset + torch.arange(batch, device=u_i.device)  # the local images' rows in the global batch
    own = rows[:, None] * slots + torch.arange(slots, device=u_i.device)[None, :]  # [B, C]: their caption slots
    candidates = logits_i2t if negatives is None else torch.cat([logits_i2t, _negative_logits(u_i, *all_neg,
                                                                                                logit_scale)], 1)
    log_p = F.log_softmax(candidates, dim=1).gather(1, own).masked_fill(~valid, 0.0)  # [B, C]
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
        acc_i2t = (candidates.argmax(1) // slots == rows).float().mean()  # a negative's column is past every caption's
        flat_valid = valid.flatten()
        acc_t2i = ((logits_t2i.argmax(1) == owner) & flat_valid).sum() / flat_valid.sum()
        matched = torch.zeros_like(logits_i2t, dtype=torch.bool).scatter_(1, own, valid)  # [B, W·B·C]
        unmatched = all_valid.flatten()[None, :] & ~matched
        logit_pos = torch.where(matched, logits_i2t, 0.0).sum() / matched.sum()
        logit_neg = torch.where(unmatched, logits_i2t, 0.0).sum() / unmatched.sum().clamp(min=1)
    terms = {"loss": loss, "acc_i2t": acc_i2t, "acc_t2i": acc_t2i, "logit_pos": logit_pos, "logit_neg": logit_neg}
    if negatives is not None:
        best = torch.where(valid, logits_i2t.gather(1, own), float("-inf")).max(1).values.detach()
        terms["acc_hard"] = _hard_accuracy(best, u_i.detach(), extra[0].detach(), negative_valid, logit_scale)
    return terms
