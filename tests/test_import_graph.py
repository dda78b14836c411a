"""No import circles in linattn, linattn_lm or benchmarks, and data/enwik8/prepare.py on the data layer
alone.  Read from the source with `ast`: imports inside functions and under `if TYPE_CHECKING:` count
too, since importing lazily or for types only hides a circle rather than removing it."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PREPARE = ROOT / "data" / "enwik8" / "prepare.py"
MODULES = {".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path
           for package in ("linattn", "linattn_lm", "benchmarks") for path in sorted((ROOT / package).rglob("*.py"))}
PACKAGES = {name for name, path in MODULES.items() if path.name == "__init__.py"}
# What prepare.py may reach of the harness: the data format and loader, how errors are reported, files
# written whole.  None of them imports the model, the settings or the commands.
DATA_LAYER = {"linattn_lm.data", "linattn_lm.errors", "linattn_lm.files"}
# Circles still there, each with the change that removes it; a stale entry fails
# `test_every_known_cycle_is_still_there`, so that it is deleted with its cause.

def absolute(module: str, node: ast.ImportFrom) -> str:
    """The module that `from <node.module> import ...` in `module` names."""
    if not node.level:
        return node.module
    package = module if module in PACKAGES else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def imported(module: str, source: str) -> set[str]:
    """The modules of MODULES that `source` (the module `module`) imports, wherever the import stands."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in MODULES}
        elif isinstance(node, ast.ImportFrom):
            base = absolute(module, node)
            for alias in node.names:
                if f"{base}.{alias.name}" in MODULES:     # from package import module
                    found.add(f"{base}.{alias.name}")
                elif base in MODULES:
                    found.add(base)
    return found - {module}


def import_graph() -> dict[str, set[str]]:
    return {name: imported(name, path.read_text()) for name, path in MODULES.items()}


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of `graph` with more than one module: each holds a circle."""
    index, low, stack, found = {}, {}, [], []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while not component or node not in component:
                component.add(stack.pop())
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def reachable(graph: dict[str, set[str]], start: set[str]) -> set[str]:
    seen, todo = set(), list(start)
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return seen


def test_no_import_cycle_in_the_library_the_harness_or_the_benchmarks():
    found = [sorted(component) for component in cycles(import_graph())]
    assert found == [], f"modules that import each other (directly or around a circle): {found}"


def test_prepare_depends_on_nothing_above_the_data_layer():
    harness = reachable(import_graph(), imported("data.enwik8.prepare", PREPARE.read_text()))
    above = sorted(name for name in harness - DATA_LAYER if name.startswith(("linattn_lm", "benchmarks")))
    assert above == [], f"prepare.py reaches harness modules above the data layer: {above}"


@pytest.mark.parametrize("source", [
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .config import ModelConfig\n",
    "def f():\n    from . import config\n",
    "import linattn_lm.config\n",
    "from linattn_lm.config import ModelConfig\n",
])
def test_type_only_lazy_and_absolute_imports_are_edges(source):
    assert imported("linattn_lm.lm", source) == {"linattn_lm.config"}


def test_a_cycle_is_found_and_a_chain_is_not():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": set()}) == []
