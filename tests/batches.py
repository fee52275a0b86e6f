"""Batches for calling an objective directly in tests: an objective reads only the per-row tensors
of its :class:`nclip.batch.Batch` (the model read the pixels and tokens)."""

from nclip.batch import Batch


def row_batch(labels=None, true_labels=None, index=None, episode=None) -> Batch:
    """A batch holding only per-row tensors (no pixels, ids or mask)."""
    return Batch(None, None, None, labels=labels, true_labels=true_labels, index=index, episode=episode)
