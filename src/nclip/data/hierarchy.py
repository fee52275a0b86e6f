"""Class hierarchies (trees of class names) and the ReCo similarity between classes.

A :class:`Hierarchy` is built from a child -> parent mapping (a root maps to ``None``; a name that
only ever appears as a parent is a root too). It answers depths, paths, tree distances, the realm
of a class (the child of the root on its path, OmniBenchmark Sec. 3.3/3.6), and the class
similarity of ReCo (OmniBenchmark, Sec. 4.3, Eq. 4):

    s(m, n) = -log( (d_min(m, n) + 1) / (2 * max(l_m, l_n) + 1) )

with d_min the length of the shortest path between m and n in the tree and l the depth.

Depth convention. The paper does not say where depth starts; we count the root as depth 0, so
a realm is at depth 1 and l_m is the number of edges from the root to m. Why:

* s >= 0 for every pair, since d_min <= l_m + l_n <= 2 max(l_m, l_n); and s = 0 exactly for two
  nodes of equal depth whose lowest common ancestor is the root -- the least related pairs get
  zero similarity, so ReCo's Bernoulli draw (Eq. 5, keep with P = 1 - s) always keeps them as
  negatives. Counting the root as 1 gives d_min <= 2 max(l) - 2, and no pair ever reaches 0.
* the self-similarity s(m, m) = log(2 l_m + 1) is the largest value of row m for every node below
  the root (for n != m, d_min >= max(l) - l_m and d_min >= 1, which bounds s(m, n) by s(m, m)
  once l_m >= 1); the root's own self-similarity is log 1 = 0, but the root is not a class.

Files (:meth:`Hierarchy.load`): JSON, an object {child: parent or null}; or a two-column TSV,
``child<TAB>parent`` per line (an empty parent: a root), blank lines and ``#`` comments skipped.
Every problem (malformed row, cycle, unknown class, ...) is one :class:`~nclip.errors.NclipError`
line naming the file and line where there is one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from nclip.errors import NclipError
from nclip.jsonio import read_text


def _names(items: Iterable[str], limit: int = 5) -> str:
    items = list(items)
    more = f" (and {len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(repr(x) for x in items[:limit]) + more


class Hierarchy:
    """A forest of named nodes; see the module docstring.

    Args:
        parents: child -> parent (``None`` for a root). Names are non-empty strings.
        require_single_root: refuse a forest (more than one root).
        where: optional child -> "FILE:LINE" used in error messages (set by :meth:`load`).
    """

    def __init__(self, parents: Mapping[str, str | None], require_single_root: bool = False,
                 where: Mapping[str, str] | None = None):
        self._where = dict(where or {})
        self._parent: dict[str, str | None] = {}
        for child, parent in parents.items():
            at = self._at(child)
            if not isinstance(child, str) or not child.strip():
                raise NclipError(f"{at}class names must be non-empty strings, got {child!r}")
            if parent is not None and (not isinstance(parent, str) or not parent.strip()):
                raise NclipError(f"{at}the parent of {child!r} must be a non-empty string or null, got {parent!r}")
            self._parent[child] = parent
        for parent in list(self._parent.values()):
            if parent is not None and parent not in self._parent:
                self._parent[parent] = None  # named only as a parent: a root
        if not self._parent:
            raise NclipError("the hierarchy is empty")
        self._children: dict[str, list[str]] = {n: [] for n in self._parent}
        for child, parent in self._parent.items():
            if parent is not None:
                self._children[parent].append(child)
        self._depth: dict[str, int] = {}
        for name in self._parent:
            self._depth_of(name)
        if require_single_root:
            _ = self.root  # raises for a forest

    def _at(self, name) -> str:
        return f"{self._where[name]}: " if name in self._where else ""

    def _depth_of(self, name: str) -> int:
        """Depth of ``name``, memoised; walks up iteratively so that deep trees do not recurse."""
        chain: list[str] = []
        node: str | None = name
        while node is not None and node not in self._depth:
            if node in chain:
                cycle = chain[chain.index(node):] + [node]
                raise NclipError(f"{self._at(node)}the hierarchy has a cycle: {' -> '.join(cycle)}")
            chain.append(node)
            node = self._parent[node]
        base = -1 if node is None else self._depth[node]
        for k, n in enumerate(reversed(chain), start=1):
            self._depth[n] = base + k
        return self._depth[name]

    # -- structure -------------------------------------------------------------------------

    @property
    def parents(self) -> dict[str, str | None]:
        """child -> parent of every node (roots -> None), in the order first seen."""
        return dict(self._parent)

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(self._parent)

    @property
    def roots(self) -> tuple[str, ...]:
        return tuple(n for n, p in self._parent.items() if p is None)

    @property
    def root(self) -> str:
        """The single root; an error for a forest."""
        roots = self.roots
        if len(roots) != 1:
            raise NclipError(f"the hierarchy must have a single root, it has {len(roots)}: {_names(roots)}")
        return roots[0]

    @property
    def classes(self) -> tuple[str, ...]:
        """The leaves (nodes without children), in the order first seen."""
        return tuple(n for n in self._parent if not self._children[n])

    leaves = classes

    def check(self, name: str) -> str:
        if name not in self._parent:
            raise NclipError(f"unknown class {name!r}: it is not a node of the hierarchy")
        return name

    def check_covers(self, labels: Iterable[str]) -> None:
        """Fail with one line if some label has no node in the hierarchy."""
        missing = [lab for lab in dict.fromkeys(labels) if lab not in self._parent]
        if missing:
            raise NclipError(f"{len(missing)} label{'s' * (len(missing) != 1)} without a node in the hierarchy: "
                             f"{_names(missing)}")

    def check_classes(self, classes: Iterable[str], of: str = "") -> None:
        """Fail with one line unless the tree fits the class set ``classes`` (a training run's class
        names; ``of``: where they come from, for the message): every class is a node, and every leaf is
        a class or lies below one (a class may be an inner node, e.g. the realm labels of a tree of
        shapes). Both lists are named, truncated."""
        classes = list(dict.fromkeys(classes))
        missing = [c for c in classes if c not in self._parent]
        known = set(classes)
        extra = [leaf for leaf in self.classes if not known.intersection(self.path(leaf))]
        parts = []
        if missing:
            parts.append(f"{len(missing)} class{'es' * (len(missing) != 1)} without a node: {_names(missing)}")
        if extra:
            parts.append(f"{len(extra)} lea{'ves' if len(extra) != 1 else 'f'} not among the classes: {_names(extra)}")
        if parts:
            where = f" {of}" if of else ""
            raise NclipError(f"the hierarchy does not match the {len(classes)} classes{where}: {'; '.join(parts)}")

    def children(self, name: str) -> tuple[str, ...]:
        return tuple(self._children[self.check(name)])

    def parent(self, name: str) -> str | None:
        return self._parent[self.check(name)]

    def depth(self, name: str) -> int:
        """Edges from the root to ``name`` (a root has depth 0)."""
        return self._depth[self.check(name)]

    def path(self, name: str) -> list[str]:
        """[root, ..., name]."""
        node: str | None = self.check(name)
        out = []
        while node is not None:
            out.append(node)
            node = self._parent[node]
        return out[::-1]

    def distance(self, m: str, n: str) -> int:
        """d_min(m, n): edges on the tree path between m and n, through their lowest common ancestor."""
        pm, pn = self.path(m), self.path(n)
        if pm[0] != pn[0]:
            raise NclipError(f"no path between {m!r} and {n!r}: they are in different trees "
                             f"(roots {pm[0]!r} and {pn[0]!r})")
        common = 0
        for a, b in zip(pm, pn):
            if a != b:
                break
            common += 1
        return (len(pm) - common) + (len(pn) - common)  # the LCA is at depth common - 1

    def similarity(self, m: str, n: str) -> float:
        """ReCo's s(m, n), Eq. 4 (natural log; root at depth 0, see the module docstring)."""
        d = self.distance(m, n)
        return math.log((2 * max(self.depth(m), self.depth(n)) + 1) / (d + 1))  # = -log((d+1)/(2l+1)), +0.0 at 0

    def normalized_similarity(self, classes: list[str], per_class: bool = False,
                              dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[C, C] Eq. 4 similarities of ``classes`` scaled into [0, 1] (Sec. 4.3: "we normalize the
        similarity between m and other classes for ensuring s(m, ·) ∈ [0, 1]").

        The paper does not say how. Default: divide by the largest value over the class set,
        diagonal included -- one scale, so the matrix stays symmetric; with all classes at one
        depth (the usual case, and the built-in hierarchies) that largest value is every class's
        self-similarity and the diagonal is 1. ``per_class``: divide row m by s(m, m), its own
        maximum (the literal "s(m, ·)"); the diagonal is 1 but the matrix is not symmetric when
        depths differ. An all-zero matrix (only roots) stays zero.
        """
        for c in classes:
            self.check(c)
        sim = torch.tensor([[self.similarity(m, n) for n in classes] for m in classes], dtype=torch.float64)
        sim = sim.reshape(len(classes), len(classes))  # [C, C]
        if per_class:
            scale = sim.diagonal().clone().unsqueeze(1)  # [C, 1], s(m, m) = log(2 l_m + 1)
            scale[scale == 0] = 1.0  # a root: its row is all zeros
        else:
            top = float(sim.max()) if sim.numel() else 0.0
            scale = torch.tensor(top if top > 0 else 1.0, dtype=torch.float64)
        return (sim / scale).clamp(0.0, 1.0).to(dtype)

    def realm(self, name: str) -> str:
        """The child of the root on ``name``'s path (a realm is its own realm)."""
        p = self.path(name)
        if len(p) < 2:
            raise NclipError(f"{name!r} is a root of the hierarchy: it has no realm")
        return p[1]

    def realms(self, classes: Iterable[str] | None = None) -> dict[str, str]:
        """{class: realm} for ``classes`` (default: every leaf)."""
        return {c: self.realm(c) for c in (self.classes if classes is None else classes)}

    # -- files -----------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path, require_single_root: bool = False) -> Hierarchy:
        """From a ``.json`` file ({child: parent or null}) or a two-column TSV (any other suffix)."""
        path, text = read_text(path, "hierarchy file")
        if path.suffix.lower() == ".json":
            parents, where = _parse_json(text, path), {}
        else:
            parents, where = _parse_tsv(text, path)
        return cls(parents, require_single_root=require_single_root, where=where)

    def save(self, path: str | Path) -> Path:
        """Write as JSON (``.json``) or TSV (any other suffix); :meth:`load` reads it back."""
        path = Path(path)
        if path.suffix.lower() == ".json":
            path.write_text(json.dumps(self._parent, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        else:
            for name in self._parent:
                if "\t" in name or "\n" in name or name.startswith("#"):
                    raise NclipError(f"class {name!r} cannot be written to a TSV file (tab, newline or leading #)")
            rows = [f"{c}\t{p or ''}" for c, p in self._parent.items()]
            path.write_text("# child\tparent (empty: a root)\n" + "\n".join(rows) + "\n", encoding="utf-8")
        return path

    def __repr__(self) -> str:
        return f"Hierarchy({len(self._parent)} nodes, {len(self.classes)} leaves, roots {list(self.roots)})"


def _parse_json(text: str, path: Path) -> dict[str, str | None]:
    def pairs(items):
        out = {}
        for k, v in items:
            if k in out:
                raise NclipError(f"{path}: class {k!r} is listed twice")
            out[k] = v
        return out

    try:
        data = json.loads(text, object_pairs_hook=pairs)
    except json.JSONDecodeError as e:
        raise NclipError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    if not isinstance(data, dict):
        raise NclipError(f"{path}: expected a JSON object {{child: parent or null}}, got {type(data).__name__}")
    return data


def _parse_tsv(text: str, path: Path) -> tuple[dict[str, str | None], dict[str, str]]:
    parents: dict[str, str | None] = {}
    where: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        at = f"{path}:{number}"
        cols = [c.strip() for c in line.split("\t")]
        if len(cols) == 1:
            raise NclipError(f"{at}: expected 'child<TAB>parent' (an empty parent for a root), got {line.strip()!r}")
        if len(cols) > 2:
            raise NclipError(f"{at}: expected 2 tab-separated columns, got {len(cols)}")
        child, parent = cols
        if not child:
            raise NclipError(f"{at}: empty class name")
        if child in parents:
            raise NclipError(f"{at}: class {child!r} is listed twice (first at line {where[child].rsplit(':', 1)[1]})")
        parents[child], where[child] = parent or None, at
    return parents, where
