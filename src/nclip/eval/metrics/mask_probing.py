"""Mask probing (xCLIP Sec. 4.2.1 and Tab. D3, following DINO Sec. 4.2.1 / Tab. 7): Jaccard of
thresholded [CLS] attention maps with foreground masks."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nclip.eval.metrics._common import as_float, positive_int


def mass_threshold(a: torch.Tensor, threshold: float, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Keep the top values of each row that hold ``threshold`` of the row's mass (DINO's rule).

    ``a`` [R, M] non-negative. DINO sorts ascending, takes the normalised cumulative sum and keeps
    entries with cumsum > 1 - threshold; equivalently an entry is kept iff the mass strictly ranked
    above it is < threshold * total. Here ties are resolved by value (all entries equal to the
    last kept value are kept), so the result does not depend on sort order -- which matters after
    nearest upsampling, where every patch value appears many times. A row of zeros keeps nothing.

    ``weights`` [M] (optional, >= 0): entry m stands for ``weights[m]`` identical pixels (a patch
    and the pixels nearest upsampling copies it to). Thresholding the weighted patch map gives
    exactly the pixel-level result of thresholding the upsampled map, at patch-level cost.
    """
    sv, order = a.sort(dim=1, descending=True)
    mass = sv if weights is None else sv * weights[order]
    excl = mass.cumsum(dim=1) - mass  # mass ranked strictly above each sorted position
    total = mass.sum(dim=1, keepdim=True)
    n_keep = (excl < threshold * total).sum(dim=1)  # a prefix of the sorted row
    thr = sv.gather(1, (n_keep - 1).clamp_min(0)[:, None])
    return (a >= thr) & (n_keep[:, None] > 0) & (total > 0)


def attention_mask_jaccard(
    attn,
    masks,
    threshold: float = 0.6,
    mode: str = "nearest",
    ignore=None,
    chunk_size: int = 16,
) -> dict:
    """Mask probing: Jaccard of thresholded [CLS] attention maps with foreground masks.

    Protocol of xCLIP Sec. 4.2.1 / Tab. D3, which follows DINO (Caron et al. 2021, Sec. 4.2.1): for
    each head of the last layer, the attention of the [CLS] query over the patches is

    1. upsampled to the mask resolution (``mode="nearest"``, DINO's choice -- each patch becomes a
       block of pixels; or ``"bilinear"``, ``align_corners=False``, for smoother boundaries);
    2. thresholded the DINO way: keep the highest-attention pixels that together hold
       ``threshold`` (DINO: 0.6) of the upsampled map's attention mass (:func:`mass_threshold`).
       With nearest upsampling this is computed exactly on the patch map, each patch weighted by
       the number of pixels it covers (for an integer scale factor: DINO's threshold-then-upsample);
    3. compared with the ground-truth foreground mask by Jaccard = |pred & gt| / |pred | gt|.

    Jaccard is averaged over samples per head; the best head is reported (the paper "retain[s] the
    attention mask with the highest similarity"). A sample whose prediction and mask are both empty
    scores 1.

    Args:
        attn: [N, heads, h, w] non-negative attention of [CLS] to the h x w patch grid.
        masks: bool (or 0/1) [N, H, W] foreground masks.
        threshold: attention-mass fraction in (0, 1].
        mode: ``"nearest"`` or ``"bilinear"``.
        ignore: optional bool [N, H, W]; True pixels (e.g. VOC's 255 "void" border) are excluded
            from both intersection and union.
        chunk_size: samples processed at a time. Nearest mode never materialises the upsampled maps
            (O(chunk x heads x h x w + chunk x H x W) memory); bilinear mode sorts every upsampled
            map, O(chunk x heads x H x W) memory and markedly slower.

    Returns:
        ``{"per_head": float64 tensor [heads], "per_sample": float64 tensor [N, heads],
        "best_head": int, "best": float}``.
    """
    a, m, valid = _jaccard_inputs(attn, masks, threshold, mode, ignore)
    chunk_size = positive_int(chunk_size, "chunk_size")
    n, heads = a.shape[:2]
    if mode == "nearest":
        src, cover = _nearest_sources(a.shape[2:], m.shape[1:], a.dtype)

    per_sample = torch.empty(n, heads, dtype=torch.float64)
    for s in range(0, n, chunk_size):
        blk = a[s : s + chunk_size]  # [b, heads, h, w]
        b = blk.shape[0]
        v = valid[s : s + b].flatten(1)  # [b, H*W]
        gt = m[s : s + b].flatten(1) & v
        if mode == "nearest":
            inter, pred_area = _overlap_nearest(blk, gt, v, threshold, src, cover)
        else:
            inter, pred_area = _overlap_bilinear(blk, gt, v, threshold, m.shape[1:])
        union = pred_area + gt.sum(-1, keepdim=True).double() - inter
        per_sample[s : s + b] = torch.where(union > 0, inter / union.clamp_min(1), torch.ones_like(union))

    per_head = per_sample.mean(dim=0)
    best_head = int(per_head.argmax())
    return {
        "per_head": per_head,
        "per_sample": per_sample,
        "best_head": best_head,
        "best": float(per_head[best_head]),
    }


def _jaccard_inputs(attn, masks, threshold: float, mode: str, ignore):
    """(attention [N, heads, h, w], bool masks [N, H, W], bool valid pixels [N, H, W]), checked."""
    a = as_float(attn, "attn", ndim=4)
    m = torch.as_tensor(masks)
    if m.dim() != 3:
        raise ValueError(f"masks must be [N, H, W], got shape {tuple(m.shape)}")
    n, heads = a.shape[:2]
    if m.shape[0] != n:
        raise ValueError(f"masks has {m.shape[0]} samples but attn has {n}")
    if n == 0 or heads == 0 or a.shape[2] == 0 or a.shape[3] == 0 or m.shape[1] == 0 or m.shape[2] == 0:
        raise ValueError(f"attn {tuple(a.shape)} and masks {tuple(m.shape)} must be non-empty")
    if bool((a < 0).any()):
        raise ValueError("attn must be non-negative (softmax attention weights)")
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must lie in (0, 1], got {threshold!r}")
    if mode not in ("nearest", "bilinear"):
        raise ValueError(f"mode must be 'nearest' or 'bilinear', got {mode!r}")
    m = m != 0 if m.dtype != torch.bool else m
    if ignore is None:
        return a, m, torch.ones_like(m)
    ig = torch.as_tensor(ignore)
    if ig.shape != m.shape:
        raise ValueError(f"ignore has shape {tuple(ig.shape)} but masks has shape {tuple(m.shape)}")
    return a, m, ~(ig != 0 if ig.dtype != torch.bool else ig)


def _nearest_sources(patches: tuple[int, int], pixels: tuple[int, int], dtype: torch.dtype):
    """The source patch of every output pixel, exactly as ``F.interpolate(mode="nearest")`` picks
    it (int64 [H*W]), and the number of pixels each patch covers ([h*w], in ``dtype``)."""
    h, w = patches
    src = torch.arange(h * w, dtype=torch.float64).view(1, 1, h, w)
    src = F.interpolate(src, size=pixels, mode="nearest").round().long().flatten()  # [H*W]
    return src, torch.bincount(src, minlength=h * w).to(dtype)


def _overlap_nearest(blk, gt, valid, threshold: float, src, cover) -> tuple[torch.Tensor, torch.Tensor]:
    """(|pred & gt|, |pred|) float64 [b, heads] for nearest upsampling, on the patch maps.

    Counts pixels per patch instead of materialising [b, heads, H, W]: a kept patch contributes all
    of its valid pixels to the prediction, its foreground ones to the overlap.
    """
    b, heads, h, w = blk.shape
    keep = mass_threshold(blk.reshape(b * heads, h * w), threshold, cover).view(b, heads, h * w)
    idx = src.expand(b, -1)
    fg_per_patch = torch.zeros(b, h * w, dtype=torch.float64).scatter_add_(1, idx, gt.double())
    valid_per_patch = torch.zeros(b, h * w, dtype=torch.float64).scatter_add_(1, idx, valid.double())
    keep = keep.double()
    return (keep * fg_per_patch[:, None]).sum(-1), (keep * valid_per_patch[:, None]).sum(-1)


def _overlap_bilinear(blk, gt, valid, threshold: float, pixels: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(|pred & gt|, |pred|) float64 [b, heads] for bilinear upsampling (every map upsampled and sorted)."""
    b, heads = blk.shape[:2]
    hh, ww = pixels
    up = F.interpolate(blk, size=(hh, ww), mode="bilinear", align_corners=False)
    pred = mass_threshold(up.reshape(b * heads, hh * ww), threshold).view(b, heads, -1) & valid[:, None]
    return (pred & gt[:, None]).sum(-1).double(), pred.sum(-1).double()
