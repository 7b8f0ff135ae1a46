"""`pipezero cluster` refuses, in one line and before building anything, what it cannot run."""

from __future__ import annotations

import pytest

from one_line import assert_one_line, run_main


@pytest.fixture
def nothing_built(monkeypatch):
    """Fail the test if the cluster would be built."""
    def build(*args, **kwargs):
        raise AssertionError("the cluster was built")

    monkeypatch.setattr("pipezero.cluster.EmulatedCluster.__enter__", build)


@pytest.mark.parametrize("inner, needle", [
    (["trian", "--pp", "2"], "invalid choice: 'trian'"),  # 37 lines of every node's torchrun before
    (["train", "--pp", "two"], "--pp"),
    (["train", "--no-such-flag"], "--no-such-flag"),
])
def test_a_wrong_inner_command_is_one_line_before_the_cluster_is_built(inner, needle, nothing_built, capsys):
    assert_one_line(*run_main(["cluster", "--nodes", "2", *inner], capsys), needle)


def test_root_without_network_admin_rights_is_one_line(monkeypatch, capsys):
    """A default container's root: `ip netns add` failed with a ClusterError traceback."""
    import os

    from pipezero import cluster

    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(cluster, "has_net_admin", lambda status=None: False)
    assert_one_line(*run_main(["cluster", "--nodes", "2", "train", "--pp", "2"], capsys), "CAP_NET_ADMIN")


def test_net_admin_is_read_from_the_effective_capabilities():
    from pipezero.cluster import has_net_admin

    assert has_net_admin("Name:\tpython\nCapEff:\t000001ffffffffff\n")  # a host's root
    assert not has_net_admin("CapEff:\t00000000a80425fb\n")  # a default container's root: bit 12 clear
    assert not has_net_admin("CapEff:\t0000000000000000\n")
    assert has_net_admin("CapEff:\t0000000000001000\n")
