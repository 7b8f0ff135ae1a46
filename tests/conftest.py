import os
import sys
from pathlib import Path

import pytest

from tiny_runs import trained_folder, trained_run  # noqa: F401  (shared: each trained once a session)

# One torch thread a process unless told otherwise: the tests' models are tiny, and a process taking
# both cores while another (a second worker, a rank) is busy waits at every operator's thread
# barrier (a linear of the tests' model: 18 us on one thread, over 1 ms on two beside other work)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Bytecode for the package and the tests, written once: every rank, launcher and command a test
    starts imports pipezero, and where PYTHONDONTWRITEBYTECODE is set (CI's containers) each of them
    compiled every module from source again (0.2-0.6 s of CPU a process, a few hundred processes)."""
    import compileall

    root = Path(__file__).resolve().parent.parent
    for folder in ("pipezero", "tests"):
        compileall.compile_dir(root / folder, quiet=2)  # a read-only checkout only loses the head start
    try:  # matplotlib lists the system's fonts (a process, fc-list) once a machine: here, not in a test
        import matplotlib.font_manager  # noqa: F401
    except ImportError:
        pass


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session: pytest.Session):
    """pytest's assertion rewriting of the test modules is kept (tests/__pycache__/*-pytest-*.pyc)
    even where PYTHONDONTWRITEBYTECODE is set: each process of each session rewrote every test
    module again (about 2 s of CPU a worker). Only while collecting: the ranks and commands tests
    start keep the environment's setting."""
    before = sys.dont_write_bytecode
    sys.dont_write_bytecode = False
    try:
        yield
    finally:
        sys.dont_write_bytecode = before


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Tokenizers and token caches go to a per-session folder: tests never see a stale user cache."""
    os.environ["PIPEZERO_CACHE"] = str(tmp_path_factory.mktemp("pipezero-cache"))


@pytest.fixture(scope="session")
def text_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small corpus: the first ~400 KB of the standard library, as a folder of .py files."""
    from pipezero.data import write_stdlib_sample

    return write_stdlib_sample(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(autouse=True)
def _processes_only_when_distributed(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast lane (`-m "not distributed"`) is one process: a test that starts a process (ranks,
    a subprocess, a network namespace's command) without the `distributed` marker fails here, so
    the lane cannot slow down unnoticed."""
    if request.node.get_closest_marker("distributed"):
        return
    import multiprocessing.process
    import subprocess

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} starts a process: mark it @pytest.mark.distributed")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`-n 2`, `--dist worksteal`): the `alone` tests first, then the `slow` ones,
    most seconds first (the marker's number), then the other tests that start ranks, then the
    one-process tests. worksteal hands each worker a contiguous share of this order and a worker with
    nothing left takes the far end of the other's share: one worker works down from the longest
    tests while the other takes the short ones from the end, so the session ends on short tests, not
    on one worker running a long test (the first tutorial: a minute and more) while the other has
    nothing to do. An `alone` test at the start waits for no long test to end before it has the
    room (a test beside it waits for it, idle). Without workers the order is the files' own."""
    if getattr(config.option, "numprocesses", None) or os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=_order)  # stable: file order kept among equals


def _order(item: pytest.Item) -> tuple[bool, float, bool]:
    slow = item.get_closest_marker("slow")
    seconds = float(slow.args[0]) if slow is not None and slow.args else 0.0
    return item.get_closest_marker("alone") is None, -seconds if slow else 1.0, \
        item.get_closest_marker("distributed") is None


@pytest.fixture(autouse=True)
def _timed_tests_run_alone(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Under pytest-xdist, a test marked `alone` (it asserts a measured time: a bubble, a straggler's
    share) runs while no other worker runs any test; the others run side by side. A reader-writer
    lock on two files shared by the session's workers: `turn` is taken by everyone on the way in,
    and held by an `alone` test until it has the room to itself, so the other worker's next test
    waits behind it instead of starving it."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    import fcntl

    alone = request.node.get_closest_marker("alone") is not None
    base = tmp_path_factory.getbasetemp().parent / "pipezero-tests"  # the session's, above each worker's
    with open(f"{base}.turn", "a") as turn, open(f"{base}.room", "a") as room:
        fcntl.flock(turn, fcntl.LOCK_EX)
        fcntl.flock(room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(turn, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(room, fcntl.LOCK_UN)

