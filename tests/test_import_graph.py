"""The package's import graph has no circle: no module reaches itself through the modules it imports, and no two
subpackages (`clipfinetune.data`, `clipfinetune.eval`, ...; a top-level module counts as its own) import each other.
Imports inside functions count as much as those at module level: they are the same dependency, only later, and the
code digests (clipfinetune/project/deps.py) follow both. A circle ties the modules in it to one another's edits (a
`shards` stage re-run by a model edit) and leaves no order in which to read or change them."""
from __future__ import annotations

import shutil
from pathlib import Path

import networkx as nx
import pytest

from clipfinetune.project import deps

ROOT = Path(__file__).resolve().parents[1]


def _name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_graph(root: Path = ROOT) -> nx.DiGraph:
    """Module -> each package module its import statements name (clipfinetune.project.deps.module_imports)."""
    graph = nx.DiGraph()
    for path in sorted((root / deps.PACKAGE).rglob("*.py")):
        graph.add_node(_name(path, root))
        for target in deps.module_imports(path):
            if target.is_relative_to(root / deps.PACKAGE) and target != path:
                graph.add_edge(_name(path, root), _name(target, root))
    return graph


def subpackage(module: str) -> str:
    return ".".join(module.split(".")[:2])


def package_graph(modules: nx.DiGraph) -> nx.DiGraph:
    """Subpackage -> subpackage, from the module edges between them."""
    graph = nx.DiGraph()
    for a, b in modules.edges:
        if subpackage(a) != subpackage(b):
            graph.add_edge(subpackage(a), subpackage(b), module_edge=(a, b))
    return graph


def circles(graph: nx.DiGraph) -> list[list]:
    return sorted(sorted(c) for c in nx.simple_cycles(graph))


def test_no_module_imports_itself_through_others():
    found = circles(module_graph())
    assert not found, f"import circles between modules: {found}"


def test_no_two_subpackages_import_each_other():
    graph = package_graph(module_graph())
    found = [[(a, b, graph.edges[a, b]["module_edge"]) for a, b in zip(c, c[1:] + c[:1])]
             for c in nx.simple_cycles(graph)]
    assert not found, f"import circles between subpackages (with one module import of each step): {found}"


@pytest.mark.parametrize("where", ["module level", "inside a function"])
def test_a_planted_circle_is_found(tmp_path, monkeypatch, where):
    """The checks above fail on a circle: io.py (imported by the evaluation) importing the evaluation suite."""
    shutil.copytree(ROOT / deps.PACKAGE, tmp_path / deps.PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(deps, "ROOT", tmp_path)
    io = tmp_path / deps.PACKAGE / "io.py"
    planted = "from clipfinetune.eval import suite\n" if where == "module level" else \
        "def _planted():\n    from clipfinetune.eval.suite import evaluate_model\n    return evaluate_model\n"
    io.write_text(io.read_text() + "\n\n" + planted)
    modules = module_graph(tmp_path)
    assert ("clipfinetune.io", "clipfinetune.eval.suite") in modules.edges
    assert any("clipfinetune.io" in c and "clipfinetune.eval.suite" in c for c in circles(modules))
    assert ["clipfinetune.eval", "clipfinetune.io"] in circles(package_graph(modules))
