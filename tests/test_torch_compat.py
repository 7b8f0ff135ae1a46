"""pipezero runs on every torch from the minimum pyproject.toml states: a torch.distributed name
that the minimum lacks (torch 2.13's reduce_scatter_single, for one) is caught here, not on a
user's GPU image."""

import ast
import re
from pathlib import Path

import pipezero
from pipezero.parallel.collectives import MINIMUM_API, MINIMUM_TORCH

ROOT = Path(pipezero.__file__).parent


def distributed_names(tree: ast.AST) -> set[str]:
    """Attributes read off `torch.distributed` however it was imported (`dist.x`, `torch.distributed.x`,
    `from torch.distributed import x`)."""
    aliases = {"torch.distributed"}
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            names |= {a.name for a in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and dotted(node.value) in aliases:
            names.add(node.attr)
    return names


def dotted(node: ast.AST) -> str | None:
    """`a.b.c` of a chain of names (what ast.unparse would print), else None: unparsing every
    attribute's object in the package took seconds."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def test_every_distributed_name_exists_in_the_minimum_torch():
    used: dict[str, list[str]] = {}
    for f in sorted(ROOT.rglob("*.py")):
        text = f.read_text()
        if "distributed" not in text:  # every name the scan reads is spelt after the word: parse only those
            continue
        for name in distributed_names(ast.parse(text)):
            used.setdefault(name, []).append(str(f.relative_to(ROOT)))
    missing = {n: fs for n, fs in used.items() if n not in MINIMUM_API}
    assert not missing, f"torch.distributed names outside torch {MINIMUM_TORCH}'s API: {missing}"
    assert "reduce_scatter_tensor" in used and "all_gather_into_tensor" in used  # the scan sees the calls


def test_the_scan_catches_a_newer_name():
    tree = ast.parse("import torch.distributed as dist\ndist.reduce_scatter_single(a, b)\n")
    assert distributed_names(tree) - MINIMUM_API == {"reduce_scatter_single"}


def test_pyproject_states_the_minimum():
    text = (ROOT.parent / "pyproject.toml").read_text()
    assert re.search(r'"torch>=(\d+)\.(\d+)"', text).groups() == tuple(str(v) for v in MINIMUM_TORCH)
