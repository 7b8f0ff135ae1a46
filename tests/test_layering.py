"""The import structure docs/ARCHITECTURE.md describes: configuration is the shared vocabulary and
imports nothing of pipezero; lower layers never import higher ones. Read from the source (AST), so
a lazy import inside a function counts as much as one at the top."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "pipezero"


@functools.lru_cache(maxsize=None)
def imported(module: Path) -> frozenset[str]:
    """Every module `module` imports anywhere in its source (`import x.y`: x.y; `from x.y import z`:
    x.y), read once a process: the tests below read the same modules again (parsing pipezero's
    sources is most of their time)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return frozenset(out)


def imports_of(module: Path) -> set[str]:
    """Every pipezero module `module` imports anywhere in its source."""
    return {m for m in imported(module) if m.startswith("pipezero")}


def test_config_imports_nothing_of_pipezero():
    assert imports_of(ROOT / "config.py") == set()


@pytest.mark.parametrize("lower, higher", [
    ("telemetry", "pipezero.planner"),  # measured timelines are drawn by telemetry's own plot module
    ("nonfinite.py", "pipezero.zero"),  # the step outcome is the loop's type; ZeRO produces it
    ("runtime/weight_grad.py", "pipezero.models"),  # a norm says how its weight gradient is computed
    ("schedules", "pipezero.runtime"),  # plans are data: no torch, no executor
    ("schedules", "pipezero.zero"),
    ("schedules", "pipezero.models"),  # the plan takes the model's shapes as data (schedules/model_shapes.py)
    ("schedules", "pipezero.memory"),  # the memory model walks programs; programs know nothing of it
    ("schedules", "pipezero.planner"),
    ("memory", "pipezero.cli"),
    ("planner", "pipezero.cli"),
    ("schedules", "pipezero.stage"),
])
def test_lower_layers_do_not_import_higher_ones(lower, higher):
    path = ROOT / lower
    for module in [path] if path.is_file() else sorted(path.rglob("*.py")):
        bad = sorted(m for m in imports_of(module) if m == higher or m.startswith(higher + "."))
        assert not bad, f"{module.relative_to(ROOT)} imports {bad}"


def test_the_plan_layer_imports_no_torch():
    """schedules/ compiles every rank's program from data (simulate, plan and the doctor run it in
    processes that never load torch)."""
    for module in sorted((ROOT / "schedules").rglob("*.py")):
        bad = sorted(n for n in imported(module) if n == "torch" or n.startswith("torch."))
        assert not bad, f"{module.relative_to(ROOT)} imports {bad}"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_cycles():
    """Modules import one another in one direction: a cycle (even one only type checkers follow)
    means two modules are one concept or one is in the wrong layer."""
    graph = {module_name(f): imports_of(f) for f in ROOT.rglob("*.py")}
    graph = {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(m):] + [m]))
        if m in done:
            return
        for d in sorted(graph[m]):
            visit(d, path + [m])
        done.add(m)

    for m in sorted(graph):
        visit(m, [])
