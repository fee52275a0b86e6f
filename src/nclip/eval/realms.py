"""Protocol 7: realm-wise linear probing (OmniBenchmark Sec. 3.6).

The benchmark is a set of realm datasets with no concept overlap; the frozen backbone is probed
by one linear classifier per realm (logistic regression, as protocol 4), top-1 accuracy is reported
per realm and averaged, and -- following ImageNet-CoG, as OmniBenchmark does -- also *relative to a
baseline model*: accuracy minus the baseline's accuracy on the same realm (Tab. 1, bottom).

On synthetic scenes a realm dataset is the set of samples whose main shape lies in that realm
(polygons, curved shapes, symbols), and the task is to tell its shapes apart. For user data, every
top-level folder is a realm (:func:`nclip.eval.datasets.realm_folders`). A class hierarchy
(:class:`nclip.data.hierarchy.Hierarchy`, realm = the child of the root on a class's path) gives the
same inputs from class labels alone: :func:`from_hierarchy`; ``nclip eval --hierarchy FILE|builtin``
gives every class-labelled dataset realm labels that way (:func:`attach_hierarchies`).
"""

from __future__ import annotations

import torch

from nclip.eval import probe


def key(name: str) -> str:
    """A realm name as it appears in result keys ("curved shape" -> "curved_shape")."""
    return "".join(ch if ch.isalnum() else "_" for ch in name.strip().lower()).strip("_") or "realm"


def from_hierarchy(hierarchy, class_names, class_ids) -> tuple[torch.Tensor, list[str]]:
    """(realm id of every sample [N], realm names) for :func:`evaluate`, from class ids [N] into
    ``class_names`` and a :class:`nclip.data.hierarchy.Hierarchy` that has a node for every class name.
    Realms are numbered in the order of the classes that first reach them."""
    hierarchy.check_covers(class_names)
    of_class = hierarchy.realms(class_names)  # {class: realm}
    names = list(dict.fromkeys(of_class[c] for c in class_names))
    lookup = torch.tensor([names.index(of_class[c]) for c in class_names], dtype=torch.long)  # [C]
    return lookup[torch.as_tensor(class_ids).long()], names


PRIMARY_KINDS = ("shape", "digit", "class")  # the class label kind of a dataset, in this order


def class_kind(label_kinds) -> str | None:
    """The label kind whose classes a hierarchy's leaves name: shape (synthetic), digit (digits),
    class (folder trees); otherwise the first kind, None without labels."""
    kinds = list(label_kinds)
    return next((k for k in PRIMARY_KINDS if k in kinds), kinds[0] if kinds else None)


def attach_hierarchies(datasets, setting: str | None) -> None:
    """Give every dataset with class labels and a train split the realm labels of a class hierarchy
    (``EvalData.realm_hierarchy``): ``setting`` is "builtin" (the built-in data's own hierarchy,
    :func:`nclip.data.hierarchies.builtin_hierarchy`) or a JSON/TSV file (:meth:`Hierarchy.load`).
    Checked up front, before any feature is extracted: an unreadable file, a dataset without a
    built-in hierarchy, a class without a node or a class that is a root are one-line errors."""
    if setting is None:
        return
    from nclip.data.hierarchies import builtin_hierarchy
    from nclip.data.hierarchy import Hierarchy
    from nclip.errors import NclipError

    shared = None if setting == "builtin" else Hierarchy.load(setting)
    for data in datasets:
        kind = class_kind(data.label_kinds)
        if kind is None or "train" not in data.splits:
            continue  # no classes to probe (captions, STS): the realm task does not apply
        names = list(data.label_kinds[kind].names)
        source = data.identity.get("kind")
        try:
            hierarchy = shared or builtin_hierarchy(source, kind)
            hierarchy.check_covers(names)
            hierarchy.realms(names)  # a class that is a root has no realm
        except NclipError as e:
            where = "builtin" if shared is None else setting
            raise NclipError(f"--hierarchy {where}: dataset {data.name} ({source}, {kind} labels): {e}") from None
        data.realm_hierarchy = (kind, hierarchy)


def evaluate(train_x, train_realm, train_cls, test_x, test_realm, test_cls, realm_names,
             l2_grid=probe.L2_GRID, seed: int = 0) -> dict[str, dict[str, float]]:
    """{realm name: {"top1", "mean_per_class", "classes", "train", "test"}} for every realm with at least
    two classes among its training samples, one with at least 3 (the L2 strength's validation split),
    and at least one test sample.

    Class ids are remapped to 0..c-1 within each realm (the realm's own label space).
    """
    train_realm, train_cls = torch.as_tensor(train_realm).long(), torch.as_tensor(train_cls).long()
    test_realm, test_cls = torch.as_tensor(test_realm).long(), torch.as_tensor(test_cls).long()
    out = {}
    for r, name in enumerate(realm_names):
        tr, te = train_realm == r, test_realm == r
        classes = torch.unique(train_cls[tr])
        if classes.numel() < 2 or int(te.sum()) == 0 or not probe.can_validate(train_cls[tr]):
            continue
        keep = torch.isin(test_cls[te], classes)  # test samples of classes never seen in training are unscorable
        if not bool(keep.any()):
            continue
        remap = torch.full((int(max(train_cls.max(), test_cls.max())) + 1,), -1, dtype=torch.long)
        remap[classes] = torch.arange(classes.numel())
        xt, yt = torch.as_tensor(test_x)[te][keep], remap[test_cls[te][keep]]
        res = probe.linear(torch.as_tensor(train_x)[tr], remap[train_cls[tr]], xt, yt, classes.numel(),
                           l2_grid=l2_grid, seed=seed)
        out[name] = {"top1": res["top1"], "mean_per_class": res["mean_per_class"],
                     "classes": int(classes.numel()), "train": int(tr.sum()), "test": int(keep.sum())}
    return out


def relative(accuracy: dict[str, float], baseline: dict[str, float]) -> dict[str, float]:
    """Accuracy minus the baseline's, for the realms both have (ImageNet-CoG / OmniBenchmark Tab. 1)."""
    return {r: accuracy[r] - baseline[r] for r in accuracy if r in baseline}
