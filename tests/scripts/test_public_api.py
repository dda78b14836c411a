"""The harness (linattn_lm, benchmarks and the scripts) uses linattn through its public API only: the
names in `linattn.__all__` and `linattn.functional.__all__`.  Read from the source with `ast`, so a
new private import or registry access fails here rather than at the library's next refactor."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import linattn
import linattn.functional

ROOT = Path(__file__).resolve().parents[2]
HARNESS = sorted([*ROOT.glob("linattn_lm/**/*.py"), *ROOT.glob("benchmarks/**/*.py"), *ROOT.glob("*.py")])
PUBLIC = {"linattn": set(linattn.__all__), "linattn.functional": set(linattn.functional.__all__)}
# Names a harness module must not touch even where they are reachable: the registry behind
# feature_map_class, and signatures of map classes (feature_map_options reads those).
FORBIDDEN_NAMES = {"FEATURE_MAPS", "signature"}


def defined_private_names(paths) -> set[str]:
    """_single_underscore names that `paths` define (functions, classes, attributes, variables)."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


# Private names of the library that the harness does not define itself: reaching one through any
# object (block._op_inputs, linattn.attention._xformers_ops) is reaching into the library.
LIBRARY_PRIVATE = defined_private_names(ROOT.glob("linattn/**/*.py")) - defined_private_names(HARNESS)


def dotted(node: ast.AST) -> str | None:
    """'linattn.functional.BACKENDS' for an attribute chain on a plain name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def public(module: str, name: str) -> bool:
    return module in PUBLIC and name in PUBLIC[module]


def violations(source: str) -> list[str]:
    """Each way `source` uses linattn other than through its public names, one line each."""
    found, aliases = [], {}
    tree = ast.parse(source)
    for node in ast.walk(tree):
        line = f"line {getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "linattn":
                    if alias.name not in PUBLIC:
                        found.append(f"{line}: import {alias.name}")
                    aliases[alias.asname or "linattn"] = alias.name if alias.asname else "linattn"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "linattn":
            for alias in node.names:
                if not public(node.module, alias.name):
                    found.append(f"{line}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Attribute):
            if node.attr in LIBRARY_PRIVATE or node.attr in FORBIDDEN_NAMES:
                found.append(f"{line}: .{node.attr}")
        elif isinstance(node, ast.Name) and node.id in FORBIDDEN_NAMES:
            found.append(f"{line}: {node.id}")
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):
        outermost = isinstance(node, ast.Attribute) and id(node) not in inner
        chain = dotted(node) if outermost else None
        root, _, rest = (chain or "").partition(".")
        if root in aliases and rest:
            module, name = aliases[root], rest.split(".")[0]
            if module == "linattn" and name == "functional" and "." in rest:
                module, name = "linattn.functional", rest.split(".")[1]
            if not public(module, name):
                found.append(f"line {node.lineno}: {chain}")
    return sorted(set(found))


@pytest.mark.parametrize("path", HARNESS, ids=lambda path: str(path.relative_to(ROOT)))
def test_the_harness_uses_only_linattns_public_api(path):
    assert violations(path.read_text()) == [], (
        f"{path.relative_to(ROOT)} reaches past linattn's public API (linattn.__all__, linattn.functional.__all__); "
        "export what it needs from linattn instead")


@pytest.mark.parametrize("source", [
    "from linattn.attention import _xformers_ops",
    "from linattn.feature_maps import FEATURE_MAPS",
    "from linattn.ops.linear_attention import backends",
    "import linattn.feature_maps",
    "import linattn\nlinattn.feature_maps.FEATURE_MAPS.get('favor')",
    "import linattn\nlinattn.attention.SOFTMAX_BACKENDS",
    "import linattn as la\nla.functional._private",
    "block._op_inputs(q, k, v)",
    "import inspect\ninspect.signature(cls)",
])
def test_each_kind_of_private_access_is_caught(source):
    assert violations(source)


def test_public_names_pass():
    assert violations("import linattn\nfrom linattn import LinearAttention, resolve_backend\n"
                      "from linattn.functional import BACKENDS\n"
                      "linattn.feature_map_options('favor'), linattn.functional.BACKENDS, block.attend") == []
