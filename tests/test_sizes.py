"""The house's sizes (issue 35): no module over 500 lines outside declarative tables, no class over 300.

A ratchet, not a style rule: a module or class that outgrows these has more than one job, and the
failure names it, so that the change that grows it splits it (as `VerifyStage.run` took the verify
stage's steps out of `SandboxManager`)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gateway", "engine_pool", "store", "core", "sandbox", "belayer", "harness_adapters", "deploy")
MODULE_LINES, CLASS_LINES = 500, 300
TABLES = {
    "core/events.py": "one frozen dataclass per event kind, each field documented, and the registry",
}
"""Declarative tables: a list of definitions, each standing alone, longer than a module may be."""


def sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if ".venv" not in p.parts)


def test_no_module_is_over_500_lines_outside_the_declarative_tables() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in sources()
        if (n := len(p.read_text().splitlines())) > MODULE_LINES and str(p.relative_to(ROOT)) not in TABLES
    }
    assert long == {}
    assert all((ROOT / table).exists() for table in TABLES)  # an entry outlives no table


@pytest.mark.parametrize("package", PACKAGES)
def test_no_class_is_over_300_lines(package: str) -> None:
    long = {
        f"{p.relative_to(ROOT)}:{node.name}": node.end_lineno - node.lineno + 1  # type: ignore[operator]
        for p in sources()
        if p.relative_to(ROOT).parts[0] == package
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > CLASS_LINES  # type: ignore[operator]
    }
    assert long == {}
