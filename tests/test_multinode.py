"""Two torchrun agents on loopback acting as two nodes, meeting through the c10d rendezvous."""

import json
import socket
import subprocess
import sys

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
