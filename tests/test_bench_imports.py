"""The benches run outside CI (they need root, minutes or a GPU), so a refactor that moves a name
they import would break them unnoticed: every `from pipezero... import name` in bench/, at the top
or inside a function, must still resolve."""

import ast
import importlib
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def pipezero_imports(path: Path) -> list[tuple[str, str, int]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "pipezero":
            out.extend((node.module, alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.Import):
            out.extend((alias.name, "", node.lineno) for alias in node.names if alias.name.split(".")[0] == "pipezero")
    return out


def test_every_name_a_bench_imports_from_pipezero_exists():
    scripts = sorted(BENCH.glob("*.py"))
    assert len(scripts) >= 10
    missing, seen = [], 0
    for script in scripts:
        for module, name, line in pipezero_imports(script):
            seen += 1
            try:
                mod = importlib.import_module(module)
            except ImportError as e:
                missing.append(f"{script.name}:{line}: {module} ({e})")
                continue
            if name and not hasattr(mod, name):
                try:  # a submodule imported by name
                    importlib.import_module(f"{module}.{name}")
                except ImportError:
                    missing.append(f"{script.name}:{line}: {module}.{name}")
    assert seen > 20  # the benches do import pipezero: the walk found them
    assert not missing, "\n".join(missing)


def imported_modules(path: Path) -> set[str]:
    """The top-level names a script imports, anywhere in it (a function's own imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
    return names


def test_no_bench_needs_pytest_or_the_tests_folder():
    """A bench runs in the venv of the README's first command (`pip install torch==... -e .`, no
    test extras): it cannot import pytest, nor anything of tests/ (whose helpers may import it)."""
    tests = {p.stem for p in (BENCH.parent / "tests").glob("*.py")} - {p.stem for p in BENCH.glob("*.py")}
    found = []
    for script in sorted(BENCH.glob("*.py")):
        text = script.read_text()
        wrong = sorted(imported_modules(script) & (tests | {"pytest", "_pytest", "tests"}))
        if wrong:
            found.append(f"{script.name} imports {', '.join(wrong)}")
        if '/ "tests"' in text or "'tests'" in text or '"tests")' in text:
            found.append(f"{script.name} puts tests/ on its path")
    assert not found, "\n".join(found)
