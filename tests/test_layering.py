"""Imports in src/hybridmoe point downward only, and no modules import each other in a cycle.

The layers, top to bottom (DESIGN.md): cli/server -> engine -> models/planning -> layers -> moe ->
platform/kernels/quant -> loader/config/demo -> errors/env. A module may import its own layer
or any layer below; every import counts, also one inside a function (a hidden cycle is still a
cycle) or under TYPE_CHECKING (a type from above is a dependency on above); cycles are
looked for among the imports that run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import hybridmoe

PACKAGE = Path(hybridmoe.__file__).parent
# top-level subpackage or module -> layer rank (higher imports lower)
RANKS = {
    "cli": 7,
    "cli_planning": 7,
    "cli_chat": 7,
    "__main__": 7,
    "server": 7,
    "cluster": 7,  # `hybridmoe cluster`: supervises `serve` subprocesses; imports no engine
    "engine": 6,
    "models": 5,
    "planning": 5,  # traces, simulator, cost model, planner: above models, below engine
    "layers": 4,
    "moe": 3,
    "platform": 2,
    "kernels": 2,
    "quant": 2,
    "loader": 1,
    "config": 1,
    "demo": 1,
    "errors": 0,
    "env": 0,
    "registry": 0,
    "__init__": 0,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, with_type_checking: bool = True) -> set[str]:
    """Every hybridmoe module the source of `module` imports, wherever the import statement is
    (a function body too); the imports under `if TYPE_CHECKING:` unless told otherwise."""
    tree = ast.parse(source)
    if not with_type_checking:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
                node.body = []
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:  # `from hybridmoe.x import y`: the submodule y, if one
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in KNOWN else node.module)
    # a module's own packages are imported before it anyway: no edge
    ancestors = {module.rsplit(".", n)[0] for n in range(1, module.count(".") + 1)}
    return {name for name in found if name in KNOWN and name != module} - ancestors


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


SOURCES = {module_name(path): path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}
KNOWN = set(SOURCES)
GRAPH = {module: imported_modules(source, module) for module, source in SOURCES.items()}
# what runs: a type named for annotations only may refer back without a cycle at import time
RUNTIME_GRAPH = {m: imported_modules(source, m, False) for m, source in SOURCES.items()}


def test_every_module_has_a_layer():
    assert {layer_of(m) for m in GRAPH} <= set(RANKS), set(map(layer_of, GRAPH)) - set(RANKS)


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_point_downward(module):
    rank = RANKS[layer_of(module)]
    upward = sorted(m for m in GRAPH[module] if RANKS[layer_of(m)] > rank)
    assert not upward, f"{module} (layer {layer_of(module)}) imports from above: {upward}"


def test_no_import_cycles():
    """Depth-first search over the graph of imports that run; a back edge is a cycle."""
    state: dict[str, str] = {}  # module -> "open" | "done"
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module], _ = "open", stack.append(module)
        for imported in sorted(RUNTIME_GRAPH[module]):
            if state.get(imported) == "open":
                cycle = stack[stack.index(imported) :] + [imported]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if imported not in state:
                visit(imported)
        state[module], _ = "done", stack.pop()

    for module in sorted(GRAPH):
        if module not in state:
            visit(module)


def test_the_check_sees_imports_inside_functions_and_type_checking_blocks():
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from hybridmoe.models.transformer import MoeCausalLM\n"
        "def f():\n    from hybridmoe.engine import engine\n    import hybridmoe.cli\n"
    )
    found = imported_modules(source, "hybridmoe.moe.fake")
    assert found >= {"hybridmoe.models.transformer", "hybridmoe.engine.engine", "hybridmoe.cli"}
    at_runtime = imported_modules(source, "hybridmoe.moe.fake", with_type_checking=False)
    assert "hybridmoe.models.transformer" not in at_runtime and "hybridmoe.cli" in at_runtime
