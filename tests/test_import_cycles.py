"""No import cycle among nclip's modules, and no import up the layers (docs/design.md, layers):
every ``import`` of an nclip module counts, module-level or inside a function (a lazy import is
still an import), read with :mod:`ast` from the source, so nothing is imported to check it."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((SRC / "nclip").rglob("*.py"))}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The nclip modules that ``name`` imports. ``from nclip.a import b`` imports ``nclip.a.b``
    when that is a module, else ``nclip.a``. A package's ``__init__`` is not counted as imported
    by its submodules (Python runs it first, but it is not the submodule's own dependency)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in modules:
                    out.add(full)
                elif base in modules:
                    out.add(base)
    out.discard(name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_the_graph_sees_function_level_imports():
    graph = import_graph()
    assert "nclip.data.synthetic" in graph["nclip.data.sources"]  # imported inside build_dataset only


def test_no_import_cycle_among_nclip_modules():
    cycles = _cycles(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


# --------------------------------------------------------------------------------------------
# Layers: docs/design.md's table, as module prefix -> layer (the longest prefix names a module's
# unit). A module may import its own unit and units of lower layers; across units of one layer only
# the pairs in SAME_LAYER (the table's "may import" column). A module under no prefix fails the test:
# a new package takes its row in docs/design.md and here.
# --------------------------------------------------------------------------------------------

LAYERS = {
    # 0: no nclip import but the pairs in SAME_LAYER
    "nclip.errors": 0, "nclip.jsonio": 0, "nclip.fileperm": 0, "nclip.runlock": 0, "nclip.rowlog": 0,
    "nclip.distributed": 0, "nclip.precision": 0, "nclip.defaults": 0, "nclip.config_files": 0, "nclip.batch": 0,
    "nclip.dataset_specs": 0, "nclip.torchvision_compat": 0,
    "nclip.plugin_consent": 0, "nclip.overwrite": 0,
    "nclip.objectives": 1, "nclip.heads": 1,
    "nclip.config": 2,
    "nclip.data": 3,
    "nclip.models": 4,
    "nclip.eval": 5,
    "nclip.train": 6,
    "nclip.embed": 7, "nclip.sweep": 7, "nclip.bench": 7, "nclip.finetune": 7,
    "nclip": 8, "nclip.__main__": 8, "nclip.cli": 8, "nclip.api": 8,
}
SAME_LAYER = {
    ("nclip.jsonio", "nclip.errors"), ("nclip.config_files", "nclip.errors"),
    ("nclip.runlock", "nclip.errors"), ("nclip.runlock", "nclip.jsonio"),
    ("nclip.objectives", "nclip.heads"),
    ("nclip.dataset_specs", "nclip.errors"), ("nclip.dataset_specs", "nclip.defaults"),
    ("nclip.overwrite", "nclip.errors"),
    ("nclip.bench", "nclip.embed"),  # the embedding pipeline's row of `nclip bench`
}
def _unit(module: str) -> str:
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in LAYERS:
            return ".".join(parts[:end])
    raise AssertionError(f"{module} is in no layer: give its package a row in docs/design.md and in LAYERS")


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(importer, imported) for every import, lazy or not, of a higher layer or of another unit of the
    same layer that SAME_LAYER does not allow. Layer 8 (cli, api, the package) imports anything."""
    found = set()
    for module, imported in graph.items():
        unit = _unit(module)
        for target in imported:
            other = _unit(target)
            if LAYERS[unit] == 8 or other == unit or LAYERS[other] < LAYERS[unit]:
                continue
            if LAYERS[other] == LAYERS[unit] and (unit, other) in SAME_LAYER:
                continue
            found.add((module, target))
    return found


def test_the_layers_test_sees_an_upward_import():
    graph = {"nclip.data.loader": {"nclip.models.towers", "nclip.config"}, "nclip.config": {"nclip.errors"},
             "nclip.errors": set(), "nclip.models.towers": set(), "nclip.embed.writer": {"nclip.sweep.grid"},
             "nclip.sweep.grid": set(), "nclip.bench.runner": {"nclip.embed.writer"}}
    assert upward_imports(graph) == {("nclip.data.loader", "nclip.models.towers"),
                                     ("nclip.embed.writer", "nclip.sweep.grid")}


def test_no_module_imports_up_the_layers():
    found = upward_imports(import_graph())
    assert not found, "imports up the layers (docs/design.md): " + "; ".join(f"{a} -> {b}" for a, b in sorted(found))

