"""The package's import structure: no circle among its modules; config and the registry free of torch.

In-process: the graph is read from the source with `ast`. An edge is any import, wherever it stands
(at the top, inside a function, under `if TYPE_CHECKING:`), and any `"paratrain.x.y:name"` string
(a spec's engine, footprint and step time, loaded when first asked for): each is a dependency."""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

import paratrain

PACKAGE_DIR = Path(paratrain.__file__).resolve().parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


LOADED_NAME = re.compile(r"^(paratrain(?:\.\w+)+):\w+$")  # what parallel.spec.load imports


def _imports(tree: ast.Module):
    """Every import statement, wherever it stands: at the top, inside a function (a deferred import
    is still a dependency) and under `if TYPE_CHECKING:` (annotations name what they need)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def _loaded_modules(tree: ast.Module):
    """The modules named by `"package.module:attribute"` strings, which specs load by name."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and (m := LOADED_NAME.match(node.value)):
            yield m.group(1)


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
        targets.update(_loaded_modules(ast.parse(path.read_text(), str(path))))
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
    assert "paratrain.runtime.process" in graph["paratrain.fault.stop"]  # at the top
    assert "paratrain.parallel.base" in graph["paratrain.parallel.dp.engine"]
    assert "paratrain.parallel.base" in graph["paratrain.parallel.registry"]  # under TYPE_CHECKING
    assert "paratrain.runtime.launch" in graph["paratrain.trainer"]  # inside a function
    assert "paratrain.parallel.dp.engine" in graph["paratrain.parallel.dp.spec"]  # a "module:Class" string
    assert "paratrain.parallel.zero.footprint" in graph["paratrain.parallel.zero.spec"]


def test_the_layout_is_one_folder_per_strategy_family():
    """parallel/ holds only the registry, the spec and the engines' contract at its top; the
    planner lives in plan/ and names no strategy; no source file is over 500 lines."""
    top = sorted(p.name for p in (PACKAGE_DIR / "parallel").glob("*.py"))
    assert top == ["__init__.py", "base.py", "registry.py", "spec.py"], top
    for family in ("dp", "zero", "tensor", "pipeline", "hybrid", "ps", "federated", "codecs"):
        assert (PACKAGE_DIR / "parallel" / family / "__init__.py").is_file(), family
    graph = import_graph()
    for module, targets in graph.items():
        if module.startswith("paratrain.plan."):
            named = {t for t in targets if t.startswith("paratrain.parallel.") and t.count(".") >= 3}
            specs = {t for t in named if t.endswith((".spec", ".engine", ".footprint", ".step_time"))}
            assert not specs, f"{module} names a strategy's own module: {sorted(specs)}"
    long = {
        str(p.relative_to(PACKAGE_DIR)): n
        for p in PACKAGE_DIR.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 500
    }
    assert not long, long


def test_no_function_is_over_100_lines():
    """A function that long does several things: each gets a name of its own."""
    long = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 100:
                long[f"{path.relative_to(PACKAGE_DIR)}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert not long, long


def test_training_code_does_not_import_the_test_tools():
    """Fault points reach the training code through runtime/fault_points.py, the faults themselves
    being installed by `paratrain run` (testing/faults.py); only the test tools, the benchmarks
    (which stage network namespaces) and the command import testing/."""
    graph = import_graph()
    users = {m for m, ts in graph.items() if any(t.startswith("paratrain.testing") for t in ts)}
    assert not {m for m in users if not m.startswith(("paratrain.testing", "paratrain.bench", "paratrain.cli"))}, users


def test_find_cycle_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def folder_of(module: str) -> str:
    """The top-level folder a module sits in (paratrain.parallel for parallel/dp/engine.py); a
    module at the package's top is a node of its own (paratrain.trainer). No folder below the
    top counts as a layer of its own: the folders alone must be acyclic (fault/ stands above
    comm/, which stands on the process basics in runtime/)."""
    return ".".join(module.split(".")[:2])


def folder_graph() -> dict[str, set[str]]:
    """folder -> the folders its modules import, by every import form; `paratrain` itself (the
    package's __init__, which loads the API on demand) is left out, being every folder's parent."""
    graph: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        here = folder_of(module)
        edges = {folder_of(t) for t in targets} - {here, "paratrain"}
        if here != "paratrain":
            graph.setdefault(here, set()).update(edges)
    return graph


def test_folders_import_one_way():
    """Read as folders (every import form folded to the folder it names), the package is layered:
    no folder reaches back to one that imports it (docs/architecture.md draws the layers)."""
    graph = folder_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "folders import each other: " + " -> ".join(cycle)
    # the layers the map draws, bottom first: nothing lower names anything higher
    assert not graph["paratrain.runtime"] - {"paratrain.errors", "paratrain.config", "paratrain.resolve"}, graph[
        "paratrain.runtime"
    ]
    assert "paratrain.comm" in graph["paratrain.fault"] and "paratrain.fault" not in graph["paratrain.comm"]
    for low in ("paratrain.comm", "paratrain.checkpoint", "paratrain.cost", "paratrain.models", "paratrain.data"):
        assert not {t for t in graph[low] if t.startswith(("paratrain.parallel", "paratrain.plan"))}, (low, graph[low])
    assert not {t for t in graph["paratrain.parallel"] if t.startswith("paratrain.plan")}, graph["paratrain.parallel"]


def test_the_folder_graph_sees_a_circle():
    """The check above would see a folder that reaches back, by any import form."""
    graph = folder_graph()
    assert "paratrain.fault" in graph["paratrain.trainer"]
    graph["paratrain.runtime"] = graph["paratrain.runtime"] | {"paratrain.trainer"}
    assert find_cycle(graph) is not None


def test_config_and_registry_import_no_torch():
    """config.py checks a config, and `paratrain --help` lists the strategies, before torch loads."""
    code = (
        "import sys, paratrain.config, paratrain.parallel.registry; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_launcher_imports_no_compiler(tmp_path):
    """What `paratrain run`'s launcher runs before its workers start (the checks on a small model,
    the agent, the checkpoint code) leaves torch.compile's modules and sympy unimported: 2 s of CPU
    a launch spent on imports it never used."""
    from reference import DIGITS_MLP

    (tmp_path / "c.toml").write_text(DIGITS_MLP)
    code = (
        "import sys; from paratrain import preflight; import paratrain.runtime.launch, paratrain.fault.supervise, "
        f"paratrain.checkpoint, paratrain.run_dir; preflight.preflight(preflight.load({str(tmp_path / 'c.toml')!r}), 2); "
        "print(sorted(m for m in ('torch._dynamo', 'torch._inductor', 'sympy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_every_spec_names_its_engine_footprint_and_step_time():
    from paratrain.parallel.base import Strategy
    from paratrain.parallel.registry import SPECS
    from paratrain.parallel.spec import load

    for name, spec in SPECS.items():
        assert spec.name == name
        assert issubclass(spec.engine(), Strategy), name
        assert callable(load(spec.footprint)), name
        assert callable(load(spec.step_time)), name
        assert spec.checkpoint_family, name
        assert "none" in spec.codecs, name
