"""Retrieval: image-text recall@k (CLIP / xCLIP Tab. 2 zero-shot image-text retrieval)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from nclip.eval.metrics._common import as_labels, cutoffs, nonempty_matrix, rank_of_target


def recall_at_k(similarity, text_to_image, ks: Sequence[int] = (1, 5, 10)) -> dict:
    """Image-text retrieval recall@k with several captions per image (COCO / Flickr protocol).

    This is the zero-shot retrieval metric of CLIP and of xCLIP Tab. 2.

    Args:
        similarity: [n_images, n_texts] similarity (e.g. cosine) between every image and caption.
        text_to_image: int [n_texts]; ``text_to_image[j]`` is the index of caption ``j``'s image.
            An image may own any number of captions (COCO: 5, Flickr30k: 5).
        ks: the cut-offs. A ``k`` larger than the number of candidates in a direction is clipped
            to that number (so it scores 1.0); the key still uses the requested ``k``.

    Returns:
        ``{"i2t@k": ..., "t2i@k": ..., "mean_recall": ...}`` with values in [0, 1].

        * image -> text: image ``i`` is a hit at ``k`` when ANY of its captions ranks in its top
          ``k`` texts; averaged over images that own at least one caption (images without a
          caption are retrieval distractors for text -> image only).
        * text -> image: caption ``j`` is a hit when its image ranks in its top ``k`` images.
        * ``mean_recall``: the mean of all the ``i2t@k`` and ``t2i@k`` values above.

    Ties count against the query (see the module docstring): a constant similarity matrix scores
    0 for every ``k`` smaller than the candidate count.
    """
    sim = nonempty_matrix(similarity, "similarity")
    n_img, n_txt = sim.shape
    t2i = as_labels(text_to_image, "text_to_image", n=n_txt, num_classes=n_img)
    ks = cutoffs(ks)

    cols = torch.arange(n_txt)
    pos = sim[t2i, cols]  # [n_txt] each caption's score with its own image

    # text -> image: rank of the caption's image in column j (chunked: [n_img, chunk] bools).
    t2i_rank = torch.empty(n_txt, dtype=torch.long)
    chunk = max(1, (1 << 24) // max(n_img, 1))
    for s in range(0, n_txt, chunk):
        e = min(s + chunk, n_txt)
        t2i_rank[s:e] = rank_of_target(sim[:, s:e].T, pos[s:e])

    # image -> text: the best-ranked caption of image i is the one with the highest score, and its
    # pessimistic rank is #{texts with score >= that score} - 1 (it counts itself once).
    best = torch.full((n_img,), -math.inf, dtype=sim.dtype).scatter_reduce(
        0, t2i, pos, reduce="amax", include_self=True
    )
    has_caption = torch.bincount(t2i, minlength=n_img) > 0
    i2t_rank = torch.empty(n_img, dtype=torch.long)
    chunk = max(1, (1 << 24) // n_txt)
    for s in range(0, n_img, chunk):
        e = min(s + chunk, n_img)
        i2t_rank[s:e] = rank_of_target(sim[s:e], best[s:e])
    i2t_rank = i2t_rank[has_caption]

    out: dict[str, float] = {}
    for k in ks:
        out[f"i2t@{k}"] = (i2t_rank < min(k, n_txt)).double().mean().item()
    for k in ks:
        out[f"t2i@{k}"] = (t2i_rank < min(k, n_img)).double().mean().item()
    out["mean_recall"] = sum(out.values()) / len(out)
    return out
