"""How the library, the harness and the benchmarks import each other, read from the source with `ast`
(imports inside functions and under `if TYPE_CHECKING:` count too, since importing lazily or for types
only hides a dependency rather than removing it): no circles, no module taking another's private names,
data/enwik8/prepare.py on the data layer alone, and every module importable."""
from __future__ import annotations

import ast
import importlib
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


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def absolute(module: str, node: ast.ImportFrom) -> str:
    """The module that `from <node.module> import ...` in `module` names."""
    if not node.level:
        return node.module
    package = module if module in PACKAGES else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def imports(module: str, source: str):
    """(line, imported linattn module, the names taken from it (None: the module itself), the name it
    is bound to where it is a module) for each import of `source` that reaches linattn."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES:
                    # `import a` binds a; `import a.b` binds a, not a.b; `import a.b as c` binds c
                    bound = alias.asname or (alias.name if "." not in alias.name else None)
                    found.append((node.lineno, alias.name, None, bound))
        elif isinstance(node, ast.ImportFrom):
            base = absolute(module, node)
            for alias in node.names:
                if f"{base}.{alias.name}" in MODULES:   # from package import module
                    found.append((node.lineno, f"{base}.{alias.name}", None, alias.asname or alias.name))
                elif base in MODULES:
                    found.append((node.lineno, base, alias.name, None))
    return found


def private_uses(module: str, source: str) -> list[tuple[str, str]]:
    """(where, the other module) for each private name of another linattn module that `source` imports
    (`from .x import _y`) or reads from an imported module (`x._y`)."""
    found, bound_modules = [], {}
    for line, target, name, bound in imports(module, source):
        if bound:
            bound_modules[bound] = target
        if name is not None and private(name) and target != module:
            found.append((f"line {line}: {name} from {target}", target))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and private(node.attr) \
                and bound_modules.get(node.value.id, module) != module:
            found.append((f"line {node.lineno}: {node.value.id}.{node.attr}", bound_modules[node.value.id]))
    return found


def imported(module: str, source: str) -> set[str]:
    """The modules of MODULES that `source` (the module `module`) imports, wherever the import stands."""
    return {target for _, target, _, _ in imports(module, source)} - {module}


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
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .lm import ModelConfig\n",
    "def f():\n    from . import lm\n",
    "import linattn_lm.lm\n",
    "from linattn_lm.lm import ModelConfig\n",
])
def test_type_only_lazy_and_absolute_imports_are_edges(source):
    assert imported("linattn_lm.settings", source) == {"linattn_lm.lm"}


def test_a_cycle_is_found_and_a_chain_is_not():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_takes_another_modules_private_names(module):
    uses = [where for where, _ in private_uses(module, MODULES[module].read_text())]
    assert uses == [], f"{module} reaches private names of other modules: make them public where they are " \
                       f"shared, or move them to the module that uses them"


ABOVE_OPS = {"linattn.functional", "linattn.attention", "linattn.feature_maps"}   # the public API over ops/


def ops_rule_breaks(module: str, source: str) -> set[str]:
    """What `source` (the ops/ module `module`) imports of the public API above ops/."""
    return imported(module, source) & ABOVE_OPS


@pytest.mark.parametrize("module", sorted(name for name in MODULES if name.startswith("linattn.ops")))
def test_ops_stay_below_the_public_api(module):
    assert ops_rule_breaks(module, MODULES[module].read_text()) == set(), \
        f"{module} imports the public API above ops/: move what it needs into ops/"


@pytest.mark.parametrize("source", ["from ...functional import LinearState", "import linattn.attention",
                                    "def f():\n    from ... import feature_maps"])
def test_an_import_from_above_ops_is_caught(source):
    assert ops_rule_breaks("linattn.ops.window_decay.window", source)


def test_custom_ops_and_functional_do_not_import_each_other():
    targets = {target for _, target, _, _ in imports("linattn.custom_ops", MODULES["linattn.custom_ops"].read_text())}
    assert "linattn.functional" not in targets


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_module_imports(module):
    importlib.import_module(module)


def test_a_type_only_import_counts():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .functional import LinearState\n"
    assert [target for _, target, _, _ in imports("linattn.custom_ops", source)] == ["linattn.functional"]


@pytest.mark.parametrize("source", [
    "from .stable import _parts",
    "from . import stable\nstable._parts(x)",
    "from .. import linear_attention as la\nla._x",
    "import linattn.ops.linear_attention.stable as st\nst._parts(x)",
    "from linattn.ops.linear_attention.torch_logspace import _chunks",
    "def f():\n    from . import torch_logspace\n    return torch_logspace._runs",
    "import linattn\nlinattn._debug",
])
def test_each_kind_of_private_access_is_caught(source):
    assert private_uses("linattn.ops.linear_attention.cpp_logspace", source)


@pytest.mark.parametrize("source", [
    "from .torch_logspace import STATE_GROUP, finish_forward\nfrom . import torch_logspace\ntorch_logspace.__name__",
    "_local = 1\nself._private",
    "from typing import _SpecialForm",
])
def test_public_names_and_own_privates_pass(source):
    assert private_uses("linattn.ops.linear_attention.cpp_logspace", source) == []
