"""The one helper that runs a function on W gloo ranks: every distributed test and benchmark uses it.
Its home is bench/, not tests/: a bench runs where only the package is installed (no pytest, no
tests/ on its path); the tests reach it through tests/ranks.py.

Each rank is a process forked from a fork server that has imported torch and pipezero once
(`rank_context`), joins through a FileStore (no fixed port), runs `fn(rank, world, *args)` and
pickles its return value to a file before tearing down, so a crash during gloo teardown ("terminate
called without an active exception") cannot turn a passed test into a failure. The parent kills
every rank after `timeout` seconds and fails with every rank's traceback.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Collection
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp


def _worker(rank: int, world: int, store_path: str, out_dir: str, fn: Callable, args: tuple, threads: int,
            parent: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    # Forked from the fork server, a rank has the server's environment, folder and path, from when
    # it started: take the test's, as a spawned rank would have.
    os.environ.clear()
    os.environ.update(parent["environ"])
    os.chdir(parent["cwd"])
    sys.path[:] = parent["path"]
    torch.set_num_threads(threads)
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    result: dict[str, Any]
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
        result = {"ok": True, "value": fn(rank, world, *args)}
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    tmp = Path(out_dir) / f".rank{rank}.tmp"
    tmp.write_bytes(pickle.dumps(result))
    tmp.rename(Path(out_dir) / f"rank{rank}.pkl")
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        os._exit(0)  # skip interpreter teardown: gloo threads can abort it after the result is safe


# What a rank imports before it runs anything: the fork server imports it once, and every rank of the
# session is forked from it with these already loaded. A spawned rank imported torch and pipezero
# again (about 2 s of CPU each, ~40 times 4 ranks a suite, on 2 cores). torch's autograd imports
# symbolic_shapes (and sympy with it, ~0.7 s of CPU) on the first backward given output gradients,
# which every stage but the last runs; numpy.random comes with the run's identity.
PRELOAD = ["torch", "torch.distributed", "pipezero.engine", "pipezero.stage", "pipezero.verify",
           "torch.fx.experimental.symbolic_shapes", "pipezero.data.identity", "numpy.random"]


def rank_context() -> Any:
    """Ranks start from a fork server that has imported PRELOAD: nothing else runs in it (no thread,
    no process group), so a fork of it is as clean as a spawn, without the imports."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


TEARDOWN_GRACE_S = 2.0  # a rank with its result written may take this long to exit before it is killed


def run_ranks(fn: Callable, world: int, *args: Any, timeout: float = 300.0, threads: int = 1,
              lost: Collection[int] = ()) -> list[Any]:
    """Run `fn(rank, world, *args)` on `world` processes; return the values in rank order. `fn` must be
    importable by name (a module-level function) because ranks are spawned, not forked. `lost`: ranks
    a fault test stops or kills: once every other rank is done they are killed, and give None."""
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        ctx = rank_context()
        parent = {"environ": dict(os.environ), "cwd": os.getcwd(), "path": list(sys.path)}
        procs = [ctx.Process(target=_worker, args=(r, world, store, tmp, fn, args, threads, parent), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        done = [Path(tmp) / f"rank{r}.pkl" for r in range(world)]
        # Until every rank's result is safe (or its process gone): a rank whose peers failed may then
        # hang in gloo's teardown, and is killed below after a short grace, as lost ranks are.
        while time.monotonic() < deadline and any(p.is_alive() and not done[r].exists()
                                                  for r, p in enumerate(procs) if r not in lost):
            time.sleep(0.05)
        grace = min(deadline, time.monotonic() + TEARDOWN_GRACE_S)
        for r, p in enumerate(procs):
            if r not in lost:
                p.join(max(0.0, grace - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive() and r not in lost and not done[r].exists()]
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        results: list[dict[str, Any] | None] = []
        for r in range(world):
            f = Path(tmp) / f"rank{r}.pkl"
            results.append(pickle.loads(f.read_bytes()) if f.exists() else None)
    errors = []
    for r, res in enumerate(results):
        if res is None and r in lost:
            continue
        if res is None:
            errors.append(f"rank {r}: {'hung (killed after timeout)' if r in hung else 'died without a result'}")
        elif not res["ok"]:
            errors.append(f"rank {r}: {res['error']}\n{res['traceback']}")
    if errors:
        raise AssertionError("distributed test failed:\n" + "\n".join(errors))
    return [res["value"] if res is not None else None for res in results]
