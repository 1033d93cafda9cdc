"""The package's import structure: no circle among its modules; config and the registry free of torch.

In-process: the graph is read from the source with `ast`."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import paratrain

PACKAGE_DIR = Path(paratrain.__file__).resolve().parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.Module):
    """Every import statement, also those run later inside functions (a deferred import is still
    a dependency), but not those under `if TYPE_CHECKING:` (read by type checkers only)."""
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            pending += node.orelse
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        pending += ast.iter_child_nodes(node)


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports, with the packages they sit in (importing a.b.c
    runs a/__init__ and a/b/__init__ first)."""
    files = {module_name(p): p for p in PACKAGE_DIR.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        own_packages = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        targets = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
                continue
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in files)
        edges = set()
        for target in targets:
            parts = target.split(".")
            edges.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        graph[name] = {t for t in edges if t in files and t != name and t not in own_packages}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports, as the list of modules around it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_graph_sees_imports():
    graph = import_graph()
    assert "paratrain.runtime" in graph["paratrain.stop"]
    assert "paratrain.parallel.base" in graph["paratrain.parallel.data_parallel"]


def test_find_cycle_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_config_and_registry_import_no_torch():
    """config.py checks a config, and `paratrain --help` lists the strategies, before torch loads."""
    code = (
        "import sys, paratrain.config, paratrain.parallel.registry; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_every_spec_names_its_engine_and_cost_model():
    from paratrain.parallel.base import Strategy
    from paratrain.parallel.registry import SPECS
    from paratrain.parallel.spec import load

    for name, spec in SPECS.items():
        assert spec.name == name
        assert issubclass(spec.engine(), Strategy), name
        assert callable(load(spec.cost_model)), name
        assert spec.checkpoint_family, name
        assert "none" in spec.codecs, name
