"""`python -m pipezero.loopback <torchrun arguments>`: torchrun whose stores listen on 127.0.0.1 only.

A local `--nproc` job needs no network, but torch's TCPStore server listens on every interface
whatever host it is given (seen with torch 2.13: `ss -ltn` shows `*:PORT` for both of torchrun's
stores), so anyone who can reach the machine could write into the rendezvous of a running job.
TCPStore accepts an already listening socket instead (`master_listen_fd`); this module hands it
one bound to 127.0.0.1 whenever a store server is asked for on a loopback host, then runs
torchrun unchanged. Multi-node runs (`pipezero cluster`) start it too: there the store is on a
node's address, which it leaves alone, trusting the cluster network.

A job that ends on a failed rank ends here in one line: the rank already said why in its own, and
torchrun's ChildFailedError traceback (its agent's, some 50 lines a node) would say nothing more.
"""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
from typing import Any

import torch.distributed as dist
import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend as c10d_backend
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main

from pipezero.lifeline import bind_child, die_with_parent, inherited_lock

LOOPBACK_HOSTS = {"127.0.0.1", "localhost"}


class LoopbackTCPStore(dist.TCPStore):
    """A TCPStore whose server, for a loopback host, listens on 127.0.0.1 and nowhere else."""

    def __init__(self, host_name: str, port: int, *args: Any, **kwargs: Any) -> None:
        is_master = kwargs.get("is_master", args[1] if len(args) > 1 else False)
        if is_master and host_name in LOOPBACK_HOSTS and kwargs.get("master_listen_fd") is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
            sock.listen(512)
            host_name, port = "127.0.0.1", sock.getsockname()[1]
            # the store owns the descriptor from here: a Python socket object kept for it would be
            # closed unclosed when collected (a ResourceWarning; under PYTHONWARNINGS=error, 'Exception
            # ignored' tracebacks from the agent), closing a descriptor the store still held
            kwargs["master_listen_fd"] = sock.detach()
            kwargs["use_libuv"] = True  # the backend that serves a listening socket it is given
        super().__init__(host_name, port, *args, **kwargs)


def bind_workers() -> None:
    """This agent dies with its launcher, and its workers with it, each keeping the run folder's lock
    open (lifeline.py). torchrun starts them through `Popen` by name in its handler module, closing
    every other descriptor: the lock's is passed by name there too."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    die_with_parent()
    fds = inherited_lock()
    bind_child(os.environ, fds[0] if fds else None)  # torchrun copies os.environ into each worker's
    subprocess_handler.Popen = functools.partial(subprocess.Popen, pass_fds=fds)  # type: ignore[attr-defined]


def main(argv: list[str]) -> None:
    dist.TCPStore = LoopbackTCPStore  # type: ignore[misc]  # rendezvous and agent stores
    c10d_backend.TCPStore = LoopbackTCPStore  # type: ignore[misc]  # imported by name there
    try:
        torchrun_main(argv)
    except ChildFailedError as e:
        failed = ", ".join(f"{rank} (exit code {f.exitcode})" for rank, f in sorted(e.failures.items()))
        print(f"pipezero: rank {failed} ended the job; each rank's own lines above say why", file=sys.stderr,
              flush=True)
        sys.exit(1)


if __name__ == "__main__":
    bind_workers()  # the agent's process only: it changes this process's environment and torchrun's Popen
    main(sys.argv[1:])
