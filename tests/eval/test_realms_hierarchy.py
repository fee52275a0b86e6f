"""Realm labels from a class hierarchy (nclip.eval.realms.from_hierarchy) equal the ones the data carries."""

import pytest
import torch

from nclip.data.hierarchies import builtin_hierarchy
from nclip.data.synthetic import SyntheticScenes
from nclip.errors import NclipError
from nclip.eval import realms
from nclip.hierarchy import Hierarchy


def test_builtin_hierarchy_reproduces_the_synthetic_realm_labels():
    data = SyntheticScenes("test", length=60, image_size=32)
    shapes = torch.tensor([data[i].labels["shape"] for i in range(len(data))])
    truth = torch.tensor([data[i].labels["realm"] for i in range(len(data))])
    ids, names = realms.from_hierarchy(builtin_hierarchy("synthetic"), data.label_spaces["shape"].names, shapes)
    assert names == list(data.label_spaces["realm"].names)
    assert torch.equal(ids, truth)


def test_realm_order_and_missing_class():
    h = Hierarchy({"b1": "B", "a1": "A", "a2": "A", "A": "root", "B": "root"})
    ids, names = realms.from_hierarchy(h, ["b1", "a1", "a2"], [2, 0, 1, 1])
    assert names == ["B", "A"] and ids.tolist() == [1, 0, 1, 1]
    with pytest.raises(NclipError, match="'c1'"):
        realms.from_hierarchy(h, ["a1", "c1"], [0])
