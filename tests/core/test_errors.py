"""One exception tree: every exception class in the code descends from `BelayerError` (the two outside it
say why in core/errors.py), and the drawing in core/errors.py's docstring names every one."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import core.errors

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = [
    "core",
    "gateway",
    "engine_pool",
    "sandbox",
    "store",
    "belayer",
    "belayer_vllm",
    "harness_adapters",
    "deploy",
]
BUILTIN_ERRORS = {
    n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)
}
OUTSIDE_ON_PURPOSE = {"_Exit", "StepFailed", "_NotOurs"}
"""Control flow of the fake shell; a PyTorch-only script; the checkpoint store's link check (always
turned into a CheckpointError before it leaves sandbox/checkpoint_store.py)."""


def exception_classes() -> tuple[set[str], set[str]]:
    """(classes under BelayerError, exception classes outside it), by name, found in the source."""
    bases: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef):
                    names = [
                        b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases
                    ]
                    bases[node.name] = names

    def reaches(name: str, targets: set[str], seen: frozenset[str] = frozenset()) -> bool:
        return name in targets or any(
            reaches(b, targets, seen | {name}) for b in bases.get(name, []) if b not in seen
        )

    exceptions = {c for c in bases if c not in BUILTIN_ERRORS and reaches(c, BUILTIN_ERRORS)}
    inside = {c for c in exceptions if reaches(c, {"BelayerError"})}
    return inside, exceptions - inside


def test_every_exception_class_is_a_belayer_error_but_the_two_that_say_why() -> None:
    inside, outside = exception_classes()
    assert {"BelayerError", "BenchError", "LayoutUnavailable", "ClientError", "Preempted"} <= inside
    assert outside == OUTSIDE_ON_PURPOSE


def test_the_drawing_names_every_class_of_the_tree_and_those_outside_it() -> None:
    inside, outside = exception_classes()
    drawing = core.errors.__doc__ or ""
    assert not {c for c in inside | outside if c not in drawing}


def test_builtin_mixins_keep_existing_except_clauses_working() -> None:
    assert issubclass(core.errors.BenchError, RuntimeError)
    assert issubclass(core.errors.TaskError, ValueError)
    assert issubclass(core.errors.SandboxUnavailable, ConnectionError)
