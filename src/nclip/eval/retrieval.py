"""Protocol 2: zero-shot image-text retrieval with several captions per image (xCLIP Tab. 4).

No prompt engineering: the original captions are the queries / candidates (xCLIP Sec. 4.1).
Image → text is a hit at k when any of the image's captions is among its k best texts; text →
image when the caption's own image is among its k best images (:func:`metrics.recall_at_k`).
:func:`failure_cases` picks the images whose best caption is wrong, for the report (Fig. 5 style).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nclip.eval.metrics import recall_at_k

KS = (1, 5, 10)


def evaluate(sim: torch.Tensor, text_to_image: torch.Tensor, ks=KS) -> dict[str, float]:
    """R@k both ways and their mean for ``sim`` [N_img, N_txt]."""
    return recall_at_k(sim, text_to_image, ks=ks)


@dataclass
class Failure:
    image: int  # index of the query image
    wrong: int  # caption retrieved first (belongs to another image)
    right: int  # the image's own caption that scored best
    rank: int  # 0-based rank of ``right`` among all captions (pessimistic on ties)
    margin: float  # score(wrong) - score(right) >= 0


def failure_cases(sim: torch.Tensor, text_to_image: torch.Tensor, n: int = 6) -> list[Failure]:
    """Up to ``n`` image → text failures, the most confident mistakes first.

    A failure is an image whose top-scoring caption belongs to another image. They are ordered by
    margin (how much the wrong caption out-scored the best right one), largest first, taking one
    failure per image that owns the wrong caption before any repeat.
    """
    sim = sim.float()
    t2i = text_to_image.long()
    own = t2i[None, :] == torch.arange(sim.shape[0])[:, None]  # [N_img, N_txt]
    has = own.any(dim=1)
    best_right = sim.masked_fill(~own, float("-inf")).max(dim=1)
    top = sim.argmax(dim=1)
    failed = has & ~own.gather(1, top[:, None])[:, 0]
    out = []
    for i in torch.nonzero(failed).flatten().tolist():
        right = int(best_right.indices[i])
        margin = float(sim[i, top[i]] - sim[i, right])
        rank = int((sim[i] >= sim[i, right]).sum()) - 1
        out.append(Failure(i, int(top[i]), right, rank, margin))
    out.sort(key=lambda f: -f.margin)
    # one example per wrongly retrieved image: a collapsed model retrieves the same caption for
    # everything, and six copies of that mistake teach less than six different ones
    picked, seen = [], set()
    for f in out:
        owner = int(t2i[f.wrong])
        if owner not in seen:
            picked.append(f)
            seen.add(owner)
    for f in out:  # top up with repeats when there are fewer distinct mistakes than n
        if len(picked) >= n:
            break
        if f not in picked:
            picked.append(f)
    return picked[:n]
