"""The shape of the house: no import circle between dflash's modules, and the stage wall holds (stage 2 never
imports stage 1, stage 1 never imports stage 2, shared/ imports neither except the CLI's lazy subcommand table)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGES = ("shared", "stage1_extract", "stage2_train")


def import_graph() -> dict[str, set[str]]:
    """Module -> the dflash modules it imports anywhere in its file (lazy and TYPE_CHECKING imports included)."""
    graph: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in (REPO / package).glob("*.py"):
            deps = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dflash."):
                    if node.module.count(".") == 1:  # from dflash.shared import cache_format
                        deps.update(f"{node.module}.{alias.name}" for alias in node.names)
                    else:
                        deps.add(node.module)
                elif isinstance(node, ast.Import):
                    deps.update(alias.name for alias in node.names if alias.name.startswith("dflash."))
            graph[f"dflash.{package}.{path.stem}"] = deps
    return graph


def test_no_module_imports_itself_through_others() -> None:
    graph = import_graph()
    circles = []

    def visit(module: str, path: list[str]) -> None:
        for dep in sorted(graph.get(module, ())):
            if dep in path:
                circles.append(path[path.index(dep):] + [dep])
            elif dep in graph:
                visit(dep, path + [dep])

    for module in graph:
        visit(module, [module])
    assert not circles, "\n".join(" -> ".join(circle) for circle in circles[:5])


def test_the_stage_wall_holds() -> None:
    crossings = [(module, dep) for module, deps in import_graph().items() for dep in deps
                 if ("stage1_extract" in module and "stage2_train" in dep)
                 or ("stage2_train" in module and "stage1_extract" in dep)
                 or (".shared." in module and ".stage" in dep)]
    assert not crossings, crossings


def test_every_module_is_installed_under_the_dflash_name() -> None:
    import importlib

    for module in import_graph():
        assert Path(importlib.import_module(module).__file__).resolve().parent.name in PACKAGES
