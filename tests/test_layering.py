"""The import structure docs/ARCHITECTURE.md describes: configuration is the shared vocabulary and
imports nothing of pipezero; lower layers never import higher ones. Read from the source (AST), so
a lazy import inside a function counts as much as one at the top."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "pipezero"


def imports_of(module: Path) -> set[str]:
    """Every pipezero module `module` imports anywhere in its source."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pipezero"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("pipezero"))
    return out


def test_config_imports_nothing_of_pipezero():
    assert imports_of(ROOT / "config.py") == set()


@pytest.mark.parametrize("lower, higher", [
    ("telemetry", "pipezero.sim"),  # measured timelines are drawn by telemetry's own plot module
    ("nonfinite.py", "pipezero.zero"),  # the step outcome is the loop's type; ZeRO produces it
    ("schedules", "pipezero.runtime"),  # plans are data: no torch, no executor
    ("schedules", "pipezero.zero"),
])
def test_lower_layers_do_not_import_higher_ones(lower, higher):
    path = ROOT / lower
    for module in [path] if path.is_file() else sorted(path.rglob("*.py")):
        bad = sorted(m for m in imports_of(module) if m == higher or m.startswith(higher + "."))
        assert not bad, f"{module.relative_to(ROOT)} imports {bad}"
