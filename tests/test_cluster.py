"""Two emulated nodes (network namespaces joined by shaped veth links), two ranks each, started by
torchrun on each node as on real machines: the run equals one process, and nothing is left behind."""

import json
import re
import socket

import pytest

from pipezero.cluster import ClusterSpec, EmulatedCluster, leftovers, require_root
from pipezero.settings import build_config
from pipezero.engine import train

TINY = """
[model]
preset = "tiny"
n_layers = 6
dim = 64
n_heads = 4
vocab_size = 256
[data]
path = "{data}"
tokenizer = "bytes"
seq_len = 32
[parallel]
micro_batch_size = 2
bucket_mb = 0.05
timeout_s = {timeout}
[optim]
lr = 1e-2
warmup_steps = 2
[run]
eval_every = 0
eval_batches = 1
sample_tokens = 0
progress = false
threads = 1
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def cluster_ok():
    require_root()  # fails (not skips) where the host cannot build namespaces: CI runs as root


@pytest.mark.distributed
@pytest.mark.slow(47)
def test_two_nodes_pp2_dp2_zero2_and_hierarchical_dp4_equal_one_process(cluster_ok, text_dir, tmp_path):
    """P=2 D=2 ZeRO-2, then P=1 D=4 ZeRO-2 with --hierarchical: its reductions inside each node (the
    2 ranks torchrun starts there, LOCAL_WORLD_SIZE), then across the shaped link."""
    toml = tmp_path / "tiny.toml"
    toml.write_text(TINY.format(data=text_dir, timeout=120))
    steps, m = 4, 2
    runs = {"pp2dp2": ["--pp", "2", "--dp", "2"], "dp4": ["--pp", "1", "--dp", "4", "--hierarchical"]}
    with EmulatedCluster(ClusterSpec(nodes=2, link="200mbit")) as cluster:
        tag = cluster.tag
        for name, layout in runs.items():
            args = ["-m", "pipezero.cli", "train", "--config", str(toml), *layout, "--zero", "2",
                    "--microbatches", str(m), "--max-steps", str(steps), "--out", str(tmp_path / name)]
            port = free_port()
            agents = [cluster.torchrun(node, 2, port, args, stdout=-1, stderr=-1) for node in range(2)]
            outs = [a.communicate(timeout=600) for a in agents]
            for a, (_, err) in zip(agents, outs):
                assert a.returncode == 0, err.decode()[-3000:]
    assert leftovers(tag) == []
    summary = json.loads((tmp_path / "dp4" / "summary.json").read_text())
    assert [r["two_level"] for r in summary["ranks"]] == [[2, 2]] * 4  # 2 nodes x 2 ranks, from torchrun
    for name, replicas in (("pp2dp2", 2), ("dp4", 4)):
        got = [json.loads(x)["loss"] for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        ref = build_config(str(toml), {"parallel.microbatches": m * replicas, "run.max_steps": steps,
                                       "run.out": str(tmp_path / f"ref{replicas}")})
        assert got == pytest.approx(train(ref).losses, rel=1e-5), name


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.alone  # each rank must reach its own 8 s timeout: beside another test's ranks the waits
# of one node's two ranks start far enough apart that its agent stopped the later one first (seen once)
def test_a_cut_link_ends_every_rank_in_bounded_time_naming_the_peer(cluster_ok, text_dir, tmp_path):
    import time

    toml = tmp_path / "tiny.toml"
    toml.write_text(TINY.format(data=text_dir, timeout=8))  # as the mended-link test: enough under load
    metrics = tmp_path / "run" / "metrics.jsonl"
    args = ["-m", "pipezero.cli", "train", "--config", str(toml), "--pp", "2", "--dp", "2", "--microbatches", "2",
            "--max-steps", "100000", "--out", str(tmp_path / "run")]
    with EmulatedCluster(ClusterSpec(nodes=2, link="200mbit")) as cluster:
        port = free_port()
        agents = [cluster.torchrun(node, 2, port, args, stdout=-1, stderr=-1) for node in range(2)]
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert time.monotonic() < deadline and all(a.poll() is None for a in agents), "the run never started"
            time.sleep(0.5)
        cluster.cut(1)
        cut_at = time.monotonic()
        errs = [a.communicate(timeout=240)[1].decode() for a in agents]
        took = time.monotonic() - cut_at
    assert all(a.returncode != 0 for a in agents)
    assert took < 120, took
    said = "\n".join(errs)
    told = "\n---\n".join(e[-2500:] for e in errs)  # each node's agent's tail: one can bury the other's
    assert all(f"pipezero: error: rank {r}, step" in said for r in range(4)), told  # every rank, one line
    # node 0's ranks name what they waited for and the unreachable peer on node 1; a cut that lands
    # in the step's norm and loss all-reduce (every rank waits in it, seen under load) has no single
    # peer to name, and says the whole group instead
    lines = "\n".join(x for x in said.splitlines() if "pipezero: error" in x)
    assert re.search(r"rank [01], step \d+: .*((from|to) rank [23]|across all 4 ranks): (timed out after 8s|failed)",
                     lines), lines


@pytest.mark.distributed
@pytest.mark.slow
def test_pipezero_cluster_stopped_leaves_no_namespace_link_or_process(cluster_ok, text_dir, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "pipezero.cli", "cluster", "--nodes", "2", "train", "--pp", "2", "--data", str(text_dir),
           "--tokenizer", "bytes", "--seq-len", "32", "--max-steps", "100000", "--out", str(out), "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (out / "metrics.jsonl").exists():
        assert time.monotonic() < deadline and proc.poll() is None, "the run never started"
        time.sleep(0.5)
    first = proc.stderr.readline()  # "pipezero: 2 emulated nodes ... (10.213.X.1..)"
    tag = f"pz{proc.pid % 100000}"
    assert len(leftovers(tag)) == 5, leftovers(tag)  # 2 namespaces, 2 host-side veth ends, the bridge
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "emulated cluster is removed" in err, first + err[-2000:]
    assert leftovers(tag) == []
    ps = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert ps == [], ps


@pytest.mark.distributed
@pytest.mark.slow(33)
def test_a_cut_link_mended_resumes_from_the_checkpoint_with_the_losses_of_an_uninterrupted_run(
        cluster_ok, text_dir, tmp_path):
    """Each node's torchrun restarts its rank after the cut fails it; the restarted ranks meet once
    the link is back and continue from the newest checkpoint, on the same losses."""
    import time

    timeout, steps = 8, 6
    toml = tmp_path / "tiny.toml"
    toml.write_text(TINY.format(data=text_dir, timeout=timeout))
    run = tmp_path / "run"
    args = ["-m", "pipezero.cli", "train", "--config", str(toml), "--dp", "2", "--zero", "1", "--microbatches", "2",
            "--max-steps", str(steps), "--checkpoint-every", "1", "--out", str(run)]
    errs = [tmp_path / f"node{node}.err" for node in range(2)]  # each node's agent and its ranks
    with EmulatedCluster(ClusterSpec(nodes=2, link="200mbit")) as cluster:
        port = free_port()
        files = [err.open("wb") for err in errs]
        agents = [cluster.torchrun(node, 1, port, args, max_restarts=2, stdout=-1, stderr=f)
                  for node, f in enumerate(files)]
        for f in files:
            f.close()  # the agents hold their own copies
        deadline = time.monotonic() + 300
        while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count("\n") >= 2):
            assert time.monotonic() < deadline and all(a.poll() is None for a in agents), "the run never started"
            time.sleep(0.2)
        cluster.cut(1)
        # mended once every rank has failed (its wait timed out and it said so): a fixed sleep past the
        # timeout mended the link before a rank of a loaded machine had failed, and that rank went on
        deadline = time.monotonic() + 120
        while not all(b"pipezero: error: rank" in err.read_bytes() for err in errs):
            assert time.monotonic() < deadline, "\n---\n".join(e.read_text(errors="replace")[-2000:] for e in errs)
            time.sleep(0.2)
        cluster.mend(1)
        for a in agents:
            a.communicate(timeout=300)
    for a, err in zip(agents, errs):
        assert a.returncode == 0, err.read_text(errors="replace")[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"] >= 1, summary["resumed_from"]  # restarted, from a checkpoint
    got = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    ref = build_config(str(toml), {"parallel.microbatches": 4, "run.max_steps": steps, "run.out": str(tmp_path / "ref")})
    assert got == pytest.approx(train(ref).losses, rel=1e-5)


def test_max_restarts_of_a_cluster_command_goes_to_torchrun_not_to_the_ranks():
    from pipezero.cluster import launcher_restarts
    from pipezero.errors import ConfigError

    assert launcher_restarts(["train", "--max-restarts", "2", "--pp", "2"]) == (2, ["train", "--pp", "2"])
    assert launcher_restarts(["train", "--max-restarts=1"]) == (1, ["train"])
    assert launcher_restarts(["train"]) == (0, ["train"])
    with pytest.raises(ConfigError, match="whole number"):
        launcher_restarts(["train", "--max-restarts", "-1"])


@pytest.mark.distributed
def test_pinned_nodes_run_on_cores_of_their_own(cluster_ok):
    """`--pin`: node i's processes see only its share of the host's cores; more nodes than cores is
    one line before anything is built."""
    import os
    import sys

    from pipezero.cluster import node_cores
    from pipezero.errors import ConfigError

    assert node_cores([3, 0, 1, 2], 2, 0) == [0, 1] and node_cores([3, 0, 1, 2], 2, 1) == [2, 3]
    host = sorted(os.sched_getaffinity(0))
    nodes = min(2, len(host))
    with EmulatedCluster(ClusterSpec(nodes=nodes, pin=True)) as cluster:
        procs = [cluster.start(i, [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                               stdout=-1) for i in range(nodes)]
        seen = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    assert seen == [node_cores(host, nodes, i) for i in range(nodes)]
    assert not set(seen[0]) & set(seen[-1]) or nodes == 1
    with pytest.raises(ConfigError, match="--pin"):
        ClusterSpec(nodes=len(host) + 1, pin=True)


@pytest.mark.distributed
def test_a_script_holding_a_cluster_and_terminated_leaves_nothing(cluster_ok):
    """SIGTERM (`timeout`, `kill`) ends a bench or script inside `with EmulatedCluster(...)` as Ctrl-C
    does: its nodes' processes are killed and every namespace and link removed."""
    import os
    import signal
    import subprocess
    import sys

    script = ("import sys, time\nfrom pipezero.cluster import ClusterSpec, EmulatedCluster\n"
              "with EmulatedCluster(ClusterSpec(nodes=2)) as c:\n"
              "    p = c.start(1, ['sleep', '3600'])\n"
              "    print(c.tag, p.pid, flush=True)\n"
              "    time.sleep(3600)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tag, pid = proc.stdout.readline().split()
    assert len(leftovers(tag)) == 5, leftovers(tag)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert "KeyboardInterrupt" in err, err[-2000:]
    assert leftovers(tag) == []
    with pytest.raises(ProcessLookupError):  # the node's process is gone too
        os.kill(int(pid), 0)


def test_the_emulated_cluster_starts_torchrun_through_the_wrapper_that_ends_quietly():
    from pipezero.cluster import ClusterSpec, EmulatedCluster

    seen = []
    cluster = EmulatedCluster.__new__(EmulatedCluster)
    cluster.spec = ClusterSpec(nodes=2, link="100mbit")
    cluster.address = lambda i: f"10.0.0.{i + 1}"
    cluster.start = lambda node, cmd, env, **kw: seen.append(cmd)
    cluster.torchrun(0, 1, 29500, ["-m", "pipezero.cli", "train"])
    assert seen[0][1:4] == ["-P", "-m", "pipezero.loopback"]  # no working folder on the ranks' import path


CHILD_OF_NODE = ("import sys, time\nfrom pipezero.cluster import ClusterSpec, EmulatedCluster\n"
                 "with EmulatedCluster(ClusterSpec(nodes=2)) as c:\n"
                 "    p = c.start(1, [sys.executable, '-c', 'from pipezero.lifeline import die_with_parent; "
                 "import time; die_with_parent(); time.sleep(3600)'])\n"
                 "    print(c.tag, p.pid, flush=True)\n"
                 "    time.sleep(3600)\n")


def _gone(pid: int, within: float) -> bool:
    import os
    import time

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # a zombie: dead, not yet reaped by init
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.distributed
def test_a_node_process_dies_with_a_cluster_killed_by_sigkill(cluster_ok):
    """`kill -9` of `pipezero cluster` runs none of its code: the torchrun agents it started (and so
    their ranks) must still end with it, not train on as orphans."""
    import os
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", CHILD_OF_NODE], stdout=subprocess.PIPE, text=True)
    tag, pid = proc.stdout.readline().split()
    proc.kill()
    proc.wait()
    try:
        assert _gone(int(pid), 10), "the node's process outlived its killed cluster"
    finally:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
        for cmd in ([f"{tag}b"], *([f"{tag}v{i}"] for i in range(2))):  # what SIGKILL could not remove
            subprocess.run(["ip", "link", "del", *cmd], capture_output=True)
        for i in range(2):
            subprocess.run(["ip", "netns", "del", f"{tag}n{i}"], capture_output=True)


@pytest.mark.distributed
def test_a_cluster_hung_up_on_removes_everything_it_made(cluster_ok):
    """SIGHUP (a closed terminal or ssh session) unwinds like SIGTERM: processes killed, namespaces
    and links removed."""
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", CHILD_OF_NODE], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    tag, pid = proc.stdout.readline().split()
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=60)
    assert "KeyboardInterrupt" in err, err[-2000:]
    assert leftovers(tag) == []
    assert _gone(int(pid), 10)


@pytest.mark.distributed
def test_the_next_cluster_removes_what_a_killed_one_left_and_keeps_a_live_ones(cluster_ok, capsys):
    """`kill -9` of `pipezero cluster` runs no teardown: its namespaces and links stayed for good,
    one set a kill. The next cluster removes them and says so, and leaves a running cluster's alone."""
    import subprocess
    import sys

    killed = subprocess.Popen([sys.executable, "-c", CHILD_OF_NODE], stdout=subprocess.PIPE, text=True)
    live = subprocess.Popen([sys.executable, "-c", CHILD_OF_NODE], stdout=subprocess.PIPE, text=True)
    try:
        dead_tag, pid = killed.stdout.readline().split()
        live_tag, _ = live.stdout.readline().split()
        killed.kill()
        killed.wait()
        assert _gone(int(pid), 10)
        assert len(leftovers(dead_tag)) == 5, leftovers(dead_tag)
        with EmulatedCluster(ClusterSpec(nodes=1)):
            assert leftovers(dead_tag) == []
            assert len(leftovers(live_tag)) == 5, leftovers(live_tag)
        said = capsys.readouterr().err
        assert f"removed what a cluster stopped without its teardown (kill -9) left behind: {dead_tag}" in said, said
        assert live_tag not in said, said
    finally:
        live.terminate()
        live.wait(timeout=60)
        for tag in (dead_tag, live_tag):
            for name in leftovers(tag):
                subprocess.run(["ip", "link", "del", name], capture_output=True)
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
