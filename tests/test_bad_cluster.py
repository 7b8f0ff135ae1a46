"""`pipezero cluster` refuses, in one line and before building anything, what it cannot run: an
inner command other than a `train` the CLI would accept on this cluster's ranks, a bad --link, data
the ranks could not read, a host whose root cannot build namespaces."""

from __future__ import annotations

import os

import pytest

from one_line import assert_one_line, run_main
from tiny_runs import TRAIN_TINY_SMALLEST, fake_run, write_docs


@pytest.fixture
def nothing_built(monkeypatch):
    """Building a cluster fails the test: every case here must be refused before."""
    import pipezero.cluster

    def built(*a, **kw):  # noqa: ANN002, ANN003
        raise AssertionError("a cluster was built for a refused command")

    monkeypatch.setattr(pipezero.cluster, "run_on_cluster", built)
    monkeypatch.setattr(pipezero.cluster.EmulatedCluster, "__enter__", built)


@pytest.fixture
def host_ok(monkeypatch):
    """This host may build clusters, whoever runs the test (the cases are about the command)."""
    import pipezero.cluster

    monkeypatch.setattr(pipezero.cluster, "require_root", lambda: None)


CASES = [
    # 37 lines of every node's torchrun before
    (["cluster", "--nodes", "2", "trian", "--pp", "2"], "invalid choice: 'trian'"),
    (["cluster", "--nodes", "2", "plan", "--preset", "tiny"], "pipezero cluster runs `train` on every node, not `plan`"),
    (["cluster", "--nodes", "2", "verify", "--dp", "2"], "pipezero cluster runs `train` on every node, not `verify`"),
    (["cluster", "--nodes", "2", "train", "--pp", "two"], "--pp"),
    (["cluster", "--nodes", "2", "train", "--pp", "0"], "--pp 0: expected an integer >= 1"),
    (["cluster", "--nodes", "2", "train", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["cluster", "--nodes", "2", "train"],
     "train's pp x dp = 1 but the cluster runs --nodes 2 x --ranks-per-node 1 = 2 ranks; make them equal"),
    (["cluster", "--nodes", "2", "train", "--dp", "2", "--nproc", "4"],
     "--nproc: the cluster starts --ranks-per-node ranks a node; drop --nproc"),
    (["cluster", "--nodes", "2", "--link", "fast", "train", "--dp", "2"],
     "--link 'fast': a tc rate such as 200mbit"),
    (["cluster", "--nodes", "2", "--link", "0mbit", "train", "--dp", "2"], "--link '0mbit': a tc rate such as 200mbit"),
    (["cluster", "--nodes", "2", "train", "--dp", "2", "--data", "/no/such/docs"], "/no/such/docs"),
]


@pytest.mark.parametrize("argv, needle", CASES, ids=[" ".join(c[0][3:6]) for c in CASES])
def test_a_bad_cluster_command_is_one_line_before_anything_is_built(argv, needle, nothing_built, host_ok, capsys):
    assert_one_line(*run_main(argv, capsys), needle)


def test_rights_are_read_from_the_effective_capabilities():
    from pipezero.cluster import missing_rights

    assert missing_rights("Name:\tpython\nCapEff:\t000001ffffffffff\n") == []  # a host's root
    assert missing_rights("Name:\tpython\nCapEff:\t00000000a80425fb\n") == ["CAP_NET_ADMIN", "CAP_SYS_ADMIN"]  # docker
    assert missing_rights("CapEff:\t0000000000001000\n") == ["CAP_SYS_ADMIN"]
    assert missing_rights("CapEff:\t0000000000000000\n") == ["CAP_NET_ADMIN", "CAP_SYS_ADMIN"]
    assert missing_rights("Name:\tpython\n") == ["CAP_NET_ADMIN", "CAP_SYS_ADMIN"]


def test_root_without_network_rights_is_one_line_before_anything_is_built(nothing_built, monkeypatch, capsys):
    """A default container's root: `ip netns add` failed with a ClusterError traceback."""
    import pipezero.cluster as cluster

    monkeypatch.setattr(cluster, "missing_rights", lambda status=None: ["CAP_NET_ADMIN", "CAP_SYS_ADMIN"])
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 0)
    assert_one_line(*run_main(["cluster", "--nodes", "2", "train", "--dp", "2"], capsys),
                    "lacks CAP_NET_ADMIN and CAP_SYS_ADMIN")


def test_a_step_ip_or_tc_refuses_is_one_line(monkeypatch, capsys):
    """`tc` refusing the link's rate mid-build is one line after the teardown, not a ClusterError."""
    import pipezero.cluster as cluster

    made: list[str] = []

    def refused(self):  # noqa: ANN001
        made.append("tried")
        raise cluster.ClusterError("`tc qdisc add dev eth0 root tbf rate 99999999999gbit` failed: rate too large")

    monkeypatch.setattr(cluster, "require_root", lambda: None)
    monkeypatch.setattr("pipezero.launch.preflight", lambda cfg, world, per_node=None: None)  # the data is not the case here
    monkeypatch.setattr(cluster.EmulatedCluster, "_build", refused)
    monkeypatch.setattr(cluster, "remove_stale", list)  # what killed clusters left: test_cluster.py, with root
    code, err = run_main(["cluster", "--nodes", "2", "train", "--dp", "2"], capsys)
    assert made and code == 1 and "Traceback" not in err
    assert err.strip().splitlines() == ["pipezero: error: the emulated cluster failed: `tc qdisc add dev eth0 root "
                                        "tbf rate 99999999999gbit` failed: rate too large"]


def test_a_link_rate_in_other_digits_is_refused_before_anything_is_built():
    """tc reads ASCII digits only: '٣mbit' (an Arabic-Indic 3) must be refused here, before the
    namespaces are made, not by tc in the middle of the build."""
    from pipezero.cluster import ClusterSpec
    from pipezero.errors import ConfigError

    with pytest.raises(ConfigError, match="--link '٣mbit': a tc rate such as 200mbit"):
        ClusterSpec(nodes=2, link="٣mbit")
    ClusterSpec(nodes=2, link="2.5gbit")


@pytest.mark.parametrize("out, needle", [("pipe", "--out 'pipe' is a file, not a folder"),
                                         ("run", "--out 'run' already holds a run (checkpoints, metrics.jsonl)"),
                                         ("run/checkpoints/x", "is inside")])
def test_a_cluster_run_folder_is_checked_before_the_cluster_is_built(out, needle, nothing_built, host_ok, tmp_path,
                                                                      monkeypatch, capsys):
    """`pipezero cluster ... train --out P` with P a pipe, or a run without --resume: refused here,
    not by node 0's rank 0 after the cluster is built, amid every node's torchrun report."""
    monkeypatch.chdir(tmp_path)
    write_docs(tmp_path)
    os.mkfifo(tmp_path / "pipe")
    fake_run(tmp_path / "run")
    code, err = run_main(["cluster", "--nodes", "2", *TRAIN_TINY_SMALLEST, "--dp", "2", "--data", "docs", "--out", out],
                         capsys)
    assert_one_line(code, err, needle)


def test_a_cluster_run_holding_a_file_as_its_trials_folder_is_refused_before_building(nothing_built, host_ok,
                                                                                        tmp_path, monkeypatch, capsys):
    """Node 0's rank 0 met it after the cluster was built: its trials wrote through a link, failed on a file."""
    monkeypatch.chdir(tmp_path)
    write_docs(tmp_path)
    fake_run(tmp_path / "run")
    (tmp_path / "run" / ".layout-trials").write_text("a user's file")
    code, err = run_main(["cluster", "--nodes", "2", *TRAIN_TINY_SMALLEST, "--dp", "2", "--data", "docs", "--out", "run",
                          "--force"], capsys)
    assert_one_line(code, err, "--out 'run' holds .layout-trials, a file, under the name --layout auto's trials take")


@pytest.mark.parametrize("link", [f"{2**70}gbit", "20tbit", "1e3gbit"])
def test_a_cluster_link_past_any_real_one_is_refused_before_building(link, nothing_built, host_ok, capsys):
    """A rate past any real link (--link 1180591620717411303424gbit) would fail in tc, mid-build."""
    code, err = run_main(["cluster", "--nodes", "2", "--link", link, *TRAIN_TINY_SMALLEST, "--dp", "2"], capsys)
    assert_one_line(code, err, f"--link {link!r}: a tc rate such as 200mbit")


@pytest.mark.parametrize("link", ["1bit", "7.9bit", "0.0001kbit"])
def test_a_cluster_link_under_a_byte_a_second_is_refused_before_building(link, nothing_built, host_ok, capsys):
    """tc keeps a rate in whole bytes a second: under 8bit it reads none, and failed mid-build with
    its usage text ('tbf: the "rate" parameter is mandatory')."""
    code, err = run_main(["cluster", "--nodes", "2", "--link", link, *TRAIN_TINY_SMALLEST, "--dp", "2"], capsys)
    assert_one_line(code, err, f"--link {link!r}: a tc rate such as 200mbit")
    assert "at least 8bit" in err


def test_cluster_rates_read_as_tc_reads_them():
    from pipezero.cluster import rate_bits

    assert rate_bits("200mbit") == 200e6
    assert rate_bits("1gibit") == 2**30
    assert rate_bits("10mbps") == 80e6
    assert rate_bits("10tbit") == 10e12
    assert rate_bits("fast") is None
