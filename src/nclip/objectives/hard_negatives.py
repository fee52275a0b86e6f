"""Hard negative captions in a batch's text slots, as the objectives that take them read them.

With hard negatives (``data.hard_negative_key`` or ``data.hard_negatives``), the batch's ids and mask
are [B, C + N, L]: each image's C caption slots (C = 1 unless ``data.caption_choice: all``), then its
N negative slots, of which ``Batch.negative_valid`` [B, N] says which hold a negative. The negatives
ride in the caption slots so that the text tower and the text heads encode them with the captions,
as one batch, and accumulation, the gradient cache and the ranks' gathers split and join them by
image rows, untouched. An objective that takes them (``Objective.hard_negatives``) splits its text
outputs [B, C + N, ...] back with :func:`split_negatives`.
"""

from __future__ import annotations

import torch

from nclip.batch import Batch


def split_negatives(text: torch.Tensor, batch: Batch | None) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                       torch.Tensor | None]:
    """(the captions' text outputs: [B, ...] with one caption slot, [B, C, ...] under
    ``caption_choice: all``; the negatives' [B, N, ...]; ``negative_valid`` [B, N]) of a text-side
    output; a batch without negatives: (``text``, None, None)."""
    valid = None if batch is None else batch.negative_valid
    if valid is None:
        return text, None, None
    n = valid.shape[1]
    captions, negatives = text[:, :-n], text[:, -n:]
    if batch.caption_valid is None:  # one caption per image: back to [B, ...]
        captions = captions[:, 0]
    return captions, negatives, valid
