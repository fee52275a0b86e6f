"""The named batch (nclip.batch): every field is split and moved alike, absent fields stay absent."""

from typing import NamedTuple

import torch

from nclip.batch import Batch


class _Crops(NamedTuple):  # as the workers' two-view crops: tensors beside plain values
    pixels: torch.Tensor
    order: tuple[int, ...]


def _batch(n: int = 10) -> Batch:
    return Batch(torch.arange(n * 3.0).reshape(n, 3), torch.arange(n * 2).reshape(n, 2), torch.ones(n, 2),
                 labels=torch.arange(n), true_labels=torch.arange(n) + 100, episode=torch.arange(n) * 7)


def test_chunk_splits_every_field_as_torch_chunk_does():
    batch = _batch(10)  # 10 rows in 4 chunks: torch.chunk gives 3, 3, 3, 1
    micro = batch.chunk(4)
    assert [len(m) for m in micro] == [len(c) for c in batch.ids.chunk(4)] == [3, 3, 3, 1]
    for name in ("pixels", "ids", "mask", "labels", "true_labels", "episode"):
        want = getattr(batch, name).chunk(4)
        assert all(torch.equal(getattr(m, name), w) for m, w in zip(micro, want)), name
    assert all(m.index is None for m in micro)  # an absent field stays absent


def test_rows_to_and_tensors_reach_the_tensors_inside_the_crops():
    crops = _Crops(torch.arange(8.0).reshape(4, 2), (2, 0, 1))
    batch = Batch(crops, torch.zeros(4, 3, dtype=torch.long), torch.ones(4, 3), labels=torch.arange(4))
    part = batch.rows(1, 3)
    assert isinstance(part.pixels, _Crops) and part.pixels.order == (2, 0, 1)
    assert torch.equal(part.pixels.pixels, crops.pixels[1:3]) and part.labels.tolist() == [1, 2]
    moved = batch.to(torch.float64)  # Tensor.to(dtype): every tensor, the crops' included
    assert [t.dtype for t in moved.tensors()] == [torch.float64] * 4
    assert moved.true_labels is None and len(batch.tensors()) == 4
