"""The layers and the one namespace, read from the source's imports (an AST walk, so nothing is executed).

- Every project import names ``sp_plan.<layer>``: a bare ``planner``/``runtime``/``cost_models``/``cli``
  import would work from a source checkout and load a second copy of the module under another name.
- Layers point one way: cli -> runtime -> planner -> cost_models; cost_models and planner never import
  torch (not even lazily inside a function).
- No import circle between modules, counting the imports inside functions too: a circle hidden behind a
  function-level import breaks as soon as someone lifts it to the top of the file.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
#: layer -> folder; the order is the dependency order (a layer may import only those before it).
LAYERS = {"cost_models": "cost_models", "planner": "planner", "runtime": "runtime", "cli": "cli"}
LAYER_RANK = {name: rank for rank, name in enumerate(LAYERS)}
OLD_TOP_LEVEL = set(LAYERS)
TORCH_FREE = ("cost_models", "planner")
SCANNED_ELSEWHERE = ("tests", "benchmarks", "examples")


def _module_name(path: Path) -> str:
    """sp_plan module name of a file under one of the layer folders."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return "sp_plan." + ".".join(parts)


def _layer_files() -> dict[str, Path]:
    files = {}
    for folder in LAYERS.values():
        for path in sorted((ROOT / folder).rglob("*.py")):
            files[_module_name(path)] = path
    return files


FILES = _layer_files()


def _imports(path: Path, module: str) -> list[tuple[str, int]]:
    """(imported module, line) for every import in the file, relative ones resolved, TYPE_CHECKING skipped."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # ``from pkg import name`` imports the submodule pkg.name when there is one.
            subs = [f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in FILES]
            found += [(name, node.lineno) for name in subs] or [(target, node.lineno)]
    return found


def _project_target(name: str) -> str | None:
    """The project module an import names (its longest known prefix), or None for a third-party one."""
    while name:
        if name in FILES:
            return name
        name = name.rpartition(".")[0]
    return None


def _layer_of(module: str) -> str:
    return module.split(".")[1]


def test_every_package_folder_is_a_layer_module():
    assert set(_layer_of(m) for m in FILES if m != "sp_plan") == set(LAYERS)


@pytest.mark.parametrize("folder", [*LAYERS.values(), *SCANNED_ELSEWHERE])
def test_no_import_uses_a_bare_layer_name(folder):
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n.split(".")[0] in OLD_TOP_LEVEL]
    assert not bad, "import through sp_plan.<layer> instead:\n" + "\n".join(bad)


def test_layers_import_only_downwards():
    bad = []
    for module, path in FILES.items():
        if module == "sp_plan":
            continue
        rank = LAYER_RANK[_layer_of(module)]
        for name, line in _imports(path, module):
            target = _project_target(name)
            if target and target != "sp_plan" and LAYER_RANK[_layer_of(target)] > rank:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {module} imports {target}")
    assert not bad, "a lower layer imports a higher one:\n" + "\n".join(bad)


@pytest.mark.parametrize("layer", TORCH_FREE)
def test_torch_free_layers_never_import_torch(layer):
    bad = [f"{path.relative_to(ROOT)}:{line}: {name}"
           for module, path in FILES.items() if module != "sp_plan" and _layer_of(module) == layer
           for name, line in _imports(path, module) if name.split(".")[0] in {"torch", "transformers", "flash_attn"}]
    assert not bad, f"{layer} must stay torch-free:\n" + "\n".join(bad)


def _import_graph() -> nx.DiGraph:
    graph = nx.DiGraph()
    for module, path in FILES.items():
        graph.add_node(module)
        for name, line in _imports(path, module):
            target = _project_target(name)
            if target and target != module:
                graph.add_edge(module, target, line=line)
    return graph


def test_no_import_circle():
    graph = _import_graph()
    circles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    shown = []
    for circle in circles:
        cycle = nx.find_cycle(graph.subgraph(circle))
        shown.append(" -> ".join(f"{a} (line {graph.edges[a, b]['line']})" for a, b in cycle) + f" -> {cycle[0][0]}")
    assert not circles, "import circles:\n" + "\n".join(shown)


def test_the_import_walk_sees_known_edges():
    """Guards the walk itself: edges that certainly exist are found (else the tests above pass vacuously)."""
    graph = _import_graph()
    assert graph.has_edge("sp_plan.cli.main", "sp_plan.cost_models.errors")
    assert graph.has_edge("sp_plan.runtime.attention.api", "sp_plan.runtime.attention.ops")
    assert graph.number_of_edges() > 300
