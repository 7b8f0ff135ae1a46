import os
from pathlib import Path

import pytest


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Tokenizers and token caches go to a per-session folder: tests never see a stale user cache."""
    os.environ["PIPEZERO_CACHE"] = str(tmp_path_factory.mktemp("pipezero-cache"))


@pytest.fixture(scope="session")
def text_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small corpus: the first ~400 KB of the standard library, as a folder of .py files."""
    from pipezero.data import stdlib_files

    root = tmp_path_factory.mktemp("corpus")
    total = 0
    for i, f in enumerate(stdlib_files()):
        text = f.read_text(encoding="utf-8", errors="replace")
        (root / f"{i:04d}.py").write_text(text)
        total += len(text)
        if total > 400_000:
            break
    return root
