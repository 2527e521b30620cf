"""The house's layout rules, checked on the source: a service uses another service only
through its client, and the shared core (``core``, ``algos``, ``rl``, ``wire``,
``compression``, ``envs``, ``common``, ``config``, ``errors``) imports no service at all."""

from __future__ import annotations

import ast
from pathlib import Path

import amprl

PACKAGE = Path(amprl.__file__).parent
SERVICES = ("actor", "replay", "paramserver", "learner", "evaluator")
CORE = ("core", "algos", "rl", "wire", "compression", "envs", "common", "config", "errors")


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) for every amprl import in a file; ``from amprl.x import y``
    gives ``amprl.x.y`` (y may be a module or a name in x)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return [(line, name) for line, name in found if name.startswith("amprl.")]


def owner(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def test_a_service_uses_another_only_through_its_client():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = owner(path)
        if me == "v1":
            continue  # generated code
        for line, name in imported_modules(path):
            parts = name.split(".")
            other = parts[1]
            if other in SERVICES and other != me:
                if me in CORE:
                    bad.append(f"{path.relative_to(PACKAGE)}:{line}: {name} (the core imports no service)")
                elif parts[2:3] != ["client"]:
                    bad.append(f"{path.relative_to(PACKAGE)}:{line}: {name} (only {other}.client)")
    assert not bad, "\n".join(bad)


def test_the_runtime_package_never_imports_the_test_support():
    """``amprl_testing`` (testing/) is not installed with the package: nothing under
    ``amprl`` may need it."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{path.relative_to(PACKAGE)}:{node.lineno}: {n}" for n in names
                    if n.split(".")[0] == "amprl_testing"]
    assert not bad, "\n".join(bad)
