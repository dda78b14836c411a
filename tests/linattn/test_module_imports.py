"""linattn's modules reach each other through public names only, and every one imports.  Read from
the source with `ast`; imports inside functions count too.  Import cycles across the library, the
harness and the benchmarks: tests/test_import_graph.py."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODULES = {".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path
           for path in sorted((ROOT / "linattn").rglob("*.py"))}
PACKAGES = {name for name, path in MODULES.items() if path.name == "__init__.py"}
# Private names one module still takes from another, each with the change that removes it; a stale
# entry fails `test_every_allowed_private_import_is_still_there`, so that it is deleted with its cause.
ALLOWED: set[tuple[str, str]] = set()


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
                    bound = alias.asname if alias.asname else None   # `import a.b` binds a, not a.b
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


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_takes_another_modules_private_names(module):
    uses = [where for where, target in private_uses(module, MODULES[module].read_text())
            if (module, target) not in ALLOWED]
    assert uses == [], f"{module} reaches private names of other modules: make them public where they are " \
                       f"shared, or move them to the module that uses them"


def test_every_allowed_private_import_is_still_there():
    for module, target in ALLOWED:
        assert any(t == target for _, t in private_uses(module, MODULES[module].read_text())), (
            f"{module} no longer takes private names of {target}: delete its entry in ALLOWED")


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
