"""Synthetic label noise (CMSF Sec. 2.2): seeded, the requested rate exactly, never the true label."""

import pytest
import torch

from nclip.data.label_noise import corrupt_labels


@pytest.mark.parametrize("n,rate,classes", [(1000, 0.05, 100), (1000, 0.5, 100), (37, 0.25, 3), (10, 0.25, 2),
                                            (8, 1.0, 5)])
def test_rate_is_exact_and_labels_change_class(n, rate, classes):
    labels = torch.randint(0, classes, (n,), generator=torch.Generator().manual_seed(n))
    noisy = corrupt_labels(labels, rate, classes, seed=3)
    changed = noisy != labels
    assert int(changed.sum()) == int(rate * n + 0.5)  # round(rate·n), half up: 2.5 → 3
    assert noisy.dtype == labels.dtype and noisy.shape == labels.shape
    assert ((noisy >= 0) & (noisy < classes)).all()
    assert torch.equal(labels, torch.randint(0, classes, (n,), generator=torch.Generator().manual_seed(n)))  # untouched


def test_seeded_and_reproducible():
    labels = torch.arange(200) % 10
    a, b = corrupt_labels(labels, 0.3, 10, seed=7), corrupt_labels(labels, 0.3, 10, seed=7)
    assert torch.equal(a, b)
    assert not torch.equal(a, corrupt_labels(labels, 0.3, 10, seed=8))
    assert torch.equal(corrupt_labels(labels, 0.0, 10, seed=7), labels)


def test_new_class_is_uniform_over_the_others():
    labels = torch.zeros(40000, dtype=torch.long)
    noisy = corrupt_labels(labels, 1.0, 5, seed=0)
    counts = torch.bincount(noisy, minlength=5)
    assert counts[0] == 0
    assert ((counts[1:].float() / 10000 - 1).abs() < 0.05).all()


def test_errors():
    bad = [((torch.tensor([0, 1]), 1.5, 3, 0), "rate"), ((torch.tensor([0, 1]), 0.5, 1, 0), "num_classes"),
           ((torch.tensor([0, 3]), 0.5, 3, 0), r"\[0, 3\)"), ((torch.tensor([0.0, 1.0]), 0.5, 3, 0), "integer")]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            corrupt_labels(*args)
