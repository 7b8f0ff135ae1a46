"""Two torchrun agents on loopback acting as two nodes, meeting through the c10d rendezvous."""

import json
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest


def free_port() -> int:
    """A free port below the kernel's ephemeral range. One that bind(0) handed out is free again once
    closed, and the kernel may hand it to any other socket (another test's ranks, under -n 2) in the
    seconds before torchrun, started after a torch import, binds it; a port outside that range is
    taken only by a bind that names it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(max(1024, low - 8192), low), 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port from {max(1024, low - 8192)} to {low}")


@pytest.mark.distributed
@pytest.mark.slow
def test_two_nodes_through_c10d_rendezvous(text_dir, tmp_path):
    port = free_port()
    out = tmp_path / "run"
    agents = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "pipezero-test",
               "-m", "pipezero.cli", "train", "--pp", "2", "--dp", "1", "--schedule", "1f1b", "--microbatches", "2",
               "--data", str(text_dir), "--tokenizer", "bytes", "--seq-len", "32", "--max-steps", "3",
               "--out", str(out), "--no-progress"]
        agents.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = [a.communicate(timeout=300) for a in agents]
    for a, (_, err) in zip(agents, results):
        assert a.returncode == 0, err[-3000:]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3]
    assert json.loads((out / "summary.json").read_text())["layout"]["pp"] == 2
