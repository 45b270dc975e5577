"""The import structure docs/design.md states, read from the source: the core's layers import only the
layers below them, the folders point one way (cli → planner → {profiler, solvers} → core), and
solvers never import torch. Imports under ``if TYPE_CHECKING:`` are annotations, not dependencies,
and are left out; imports inside functions count."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# The core, bottom up: each module may import the modules of the layers before its own.
CORE_LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"errors"}),
    frozenset({"units"}),
    frozenset({"region"}),
    frozenset({"graph", "joint"}),
    frozenset({"remat", "repeats", "sharding"}),
    frozenset({"simulation", "partition"}),
    frozenset({"timeline"}),
    frozenset({"plan"}),
    frozenset({"build"}),
)
# What each folder (an installed subpackage) may import besides the core.
FOLDER_MAY_IMPORT = {
    "solvers": {"solvers"},
    "profiler": {"profiler"},
    "planner": {"planner", "profiler", "solvers"},
    "cli": {"cli", "planner", "profiler", "solvers"},
}
SUBPACKAGES = set(FOLDER_MAY_IMPORT)


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and (
        (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")
    )


def runtime_imports(path: Path) -> set[str]:
    """Every module ``path`` imports when it runs (top level or inside functions)."""
    found: set[str] = set()
    stack: list[ast.AST] = [ast.parse(path.read_text(), str(path))]
    while stack:
        node = stack.pop()
        if _is_type_checking_block(node):
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
        stack.extend(ast.iter_child_nodes(node))
    return found


def _core_layer(name: str) -> int:
    for depth, layer in enumerate(CORE_LAYERS):
        if name in layer:
            return depth
    raise AssertionError(f"ckptplan/{name}.py is in no layer of CORE_LAYERS: place it")


CORE_MODULES = sorted(p.stem for p in (ROOT / "ckptplan").glob("*.py") if p.stem != "__init__")


def upward_imports(name: str, path: Path) -> list[str]:
    """The imports of core module ``name`` (source at ``path``) that are not of a layer below it."""
    depth, wrong = _core_layer(name), []
    for module in sorted(runtime_imports(path)):
        parts = module.split(".")
        if parts[0] != "ckptplan":
            continue
        if len(parts) == 1 or parts[1] in SUBPACKAGES or _core_layer(parts[1]) >= depth:
            wrong.append(module)
    return wrong


@pytest.mark.parametrize("name", CORE_MODULES)
def test_core_modules_import_only_layers_below(name: str) -> None:
    assert upward_imports(name, ROOT / "ckptplan" / f"{name}.py") == []


def test_an_upward_import_is_caught_and_an_annotation_is_not(tmp_path: Path) -> None:
    source = tmp_path / "graph.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from ckptplan.region import Region\n"
        "if TYPE_CHECKING:\n    from ckptplan.plan import Plan\n"
        "def peak(graph):\n    from ckptplan.simulation import simulate\n    return simulate(graph)\n"
    )
    assert upward_imports("graph", source) == ["ckptplan.simulation"]


@pytest.mark.parametrize("folder", sorted(FOLDER_MAY_IMPORT))
def test_folders_import_one_way(folder: str) -> None:
    for path in sorted((ROOT / folder).glob("*.py")):
        for module in sorted(runtime_imports(path)):
            parts = module.split(".")
            if parts[0] == "ckptplan" and len(parts) > 1 and parts[1] in SUBPACKAGES:
                assert parts[1] in FOLDER_MAY_IMPORT[folder], f"{folder}/{path.name} imports {module}"


def test_solvers_and_the_core_never_import_torch() -> None:
    for path in [*sorted((ROOT / "solvers").glob("*.py")), *sorted((ROOT / "ckptplan").glob("*.py"))]:
        torch_imports = sorted(m for m in runtime_imports(path) if m.split(".")[0] == "torch")
        assert not torch_imports, f"{path.relative_to(ROOT)} imports {torch_imports[0]}"


def test_the_facade_takes_each_name_from_its_own_layer() -> None:
    """``ckptplan``'s lazily loaded names come from the modules that define them: the simulator
    and ``make_plan`` from the core, so using them loads no torch; the rest from the folders
    above, each the object that folder exports."""
    import importlib
    import subprocess
    import sys

    import ckptplan

    core = {name: module for name, module in ckptplan._LAZY.items() if module.split(".")[1] not in SUBPACKAGES}
    assert core == {"simulate": "ckptplan.simulation", "make_plan": "ckptplan.build"}
    for name, module in ckptplan._LAZY.items():
        assert getattr(ckptplan, name) is getattr(importlib.import_module(module), name), name
    script = "import sys, ckptplan; ckptplan.simulate, ckptplan.make_plan; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"
