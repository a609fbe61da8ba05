"""The import graph follows the layers docs/architecture.md lists: every import (at module level,
inside a function, or for type checking only) runs down the list, and no imports form a cycle.

The list is read from the document, so the drawing a newcomer reads and the rule the code keeps
cannot drift apart.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# repository folder -> the package it installs as (pyproject.toml's package-dir)
FOLDERS = {"expertmesh": "expertmesh", "node": "expertmesh.node", "coordinator": "expertmesh.coordinator"}
GENERATED = "expertmesh.v1"  # proto/expertmesh/v1: imports only protobuf and grpc


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


MODULES = _modules()


def _layers() -> list[list[str]]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"```layers\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no ```layers block"
    return [line.split() for line in block.group(1).splitlines() if line.strip()]


LAYERS = _layers()


ENTRIES = [entry for line in LAYERS for entry in line]


def _holds(entry: str, module: str) -> bool:
    """Whether `module` is `entry`, or inside it; a package with entries of its own beneath it
    (`expertmesh`, `expertmesh.node`) is its `__init__` alone."""
    if module == entry:
        return True
    nested = any(other.startswith(entry + ".") for other in ENTRIES)
    return not nested and module.startswith(entry + ".")


def _entry(module: str) -> tuple[int, str]:
    """(the module's line in the list, counted from the bottom; its entry)."""
    best: tuple[int, str] | None = None
    for depth, line in enumerate(reversed(LAYERS)):
        for entry in line:
            if _holds(entry, module):
                best = (depth, entry)
    assert best is not None, f"{module} is in no layer of docs/architecture.md"
    return best


def _is_package(module: str) -> bool:
    path = MODULES.get(module)
    return path is not None and path.name == "__init__.py"


def _imports(module: str, path: Path) -> list[tuple[str, int]]:
    """(imported expertmesh module, line) for every import statement in the file."""
    out = []
    package = module if _is_package(module) else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.startswith("expertmesh")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if not base.startswith("expertmesh"):
                continue
            for alias in node.names:  # `from package import module` imports that module
                name = f"{base}.{alias.name}"
                out.append((name if name in MODULES else base, node.lineno))
    return out


@functools.cache
def _graph() -> dict[str, list[tuple[str, int]]]:
    """Every module's imports, parsed when a test first asks (not while the suite is collected,
    which every worker does)."""
    return {m: _imports(m, p) for m, p in MODULES.items()}


def test_every_module_is_in_a_layer():
    for module in MODULES:
        _entry(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_run_down_the_layers(module: str):
    depth, entry = _entry(module)
    wrong = []
    for target, line in _graph()[module]:
        if target == GENERATED or target.startswith(GENERATED + "."):
            target_depth, target_entry = 0, GENERATED
        else:
            target_depth, target_entry = _entry(target)
        if target_entry == entry:
            continue
        if target_depth >= depth:
            wrong.append(f"{MODULES[module].relative_to(ROOT)}:{line} imports {target} ({target_entry})")
    assert not wrong, f"{module} ({entry}) imports up or across the layers:\n" + "\n".join(wrong)


def test_no_imports_form_a_cycle():
    """A cycle that a function-level import hides is still a cycle: two modules that need each
    other belong together, or the concept they share belongs below both."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        stack.append(module)
        for target, _ in _graph().get(module, []):
            if target not in _graph() or target == module:
                continue
            if state.get(target) == 1:
                return [*stack[stack.index(target) :], target]
            if state.get(target) is None and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[module] = 2
        return None

    for module in sorted(_graph()):
        if module not in state and (cycle := visit(module)):
            pytest.fail("imports form a cycle: " + " -> ".join(cycle))
