"""Two-level all-reduce and reduce-scatter (parallel/hierarchical.py) leave what the flat gloo
collectives leave, on 4 ranks as 2 "nodes" x 2 (node = rank // 2) and on the degenerate splits."""

from __future__ import annotations

import pytest

import torch

from ranks import run_ranks


def cases(rank: int, world: int) -> list[str]:
    import torch.distributed as dist
    from datetime import timedelta

    from pipezero.parallel.hierarchical import (all_reduce, build_hierarchy, reduce_scatter, start_all_reduce,
                                                start_reduce_scatter)

    checked = []
    splits = {"2x2": ([[0, 1, 2, 3]], 2), "4x1": ([[0, 1, 2, 3]], 1), "1x4": ([[0, 1, 2, 3]], 4),
              # two groups of a mesh (the dp groups of P=2, D=2 pp-inner: {0, 2}, {1, 3}), one node each rank pair
              "pairs": ([[0, 2], [1, 3]], 2)}
    for name, (groups, per_node) in splits.items():
        h = build_hierarchy(groups, per_node)
        group_ranks = next(g for g in groups if rank in g)
        flat_group = dist.new_group(group_ranks) if len(groups) == 1 else None
        if flat_group is None:  # every rank creates every group, in one order
            made = [dist.new_group(g) for g in groups]
            flat_group = made[next(i for i, g in enumerate(groups) if rank in g)]
        w = len(group_ranks)
        gen = torch.Generator().manual_seed(rank)
        for numel in (w * 5, w * 1000, 37):  # integers in floats: sums are exact in any order
            x = torch.randint(-50, 50, (numel,), generator=gen).float()
            want = x.clone()
            dist.all_reduce(want, group=flat_group)
            got = x.clone()
            all_reduce(got, h)
            assert torch.equal(got, want), (name, numel, "all_reduce")
            got = x.clone()
            start_all_reduce(got, h).wait(timeout=timedelta(seconds=60))
            assert torch.equal(got, want), (name, numel, "start_all_reduce")
            if numel % w:
                continue
            want_rs = torch.empty(numel // w)
            dist.reduce_scatter_tensor(want_rs, x.clone(), group=flat_group)
            got_rs = torch.empty(numel // w)
            reduce_scatter(got_rs, x, h)
            assert torch.equal(got_rs, want_rs), (name, numel, "reduce_scatter")
            got_rs = torch.full((numel // w,), float("nan"))
            start_reduce_scatter(got_rs, x, h).wait(timeout=timedelta(seconds=60))
            assert torch.equal(got_rs, want_rs), (name, numel, "start_reduce_scatter")
        h.close()
        checked.append(name)
    # the one-level exchange on its own, started and waited for as ZeRO waits for its works
    from pipezero.parallel.hierarchical import start_exchange

    x = torch.randint(-50, 50, (world * 300,), generator=torch.Generator().manual_seed(rank)).float()
    want = torch.empty(300)
    dist.reduce_scatter_tensor(want, x.clone())
    got = torch.full((300,), float("nan"))
    assert start_exchange(got, x, dist.group.WORLD).wait(timeout=timedelta(seconds=60)) is not False
    assert torch.equal(got, want)
    # bf16 slices: summed in fp32 and rounded once (sums of four bf16 numbers of this range are
    # exact in fp32, so the rounded sum is one number whatever the order)
    xb = (torch.randn(world * 300, generator=torch.Generator().manual_seed(rank)) * 3).bfloat16()
    every = torch.empty(world * world * 300)
    dist.all_gather_into_tensor(every, xb.float())
    want_b = every.view(world, world, 300)[:, rank].sum(0).bfloat16()
    got_b = torch.empty(300, dtype=torch.bfloat16)
    start_exchange(got_b, xb, dist.group.WORLD).wait(timeout=timedelta(seconds=60))
    assert torch.equal(got_b, want_b)
    checked.append("exchange")
    # the gather by exchange fills what all_gather_into_tensor fills: from a shard apart (ZeRO-3's
    # master) and from the member's own slice of the output (ZeRO-1/2's updated weights)
    from pipezero.parallel.hierarchical import start_gather_exchange

    shard = torch.randint(-50, 50, (300,), generator=torch.Generator().manual_seed(rank)).float()
    want_g = torch.empty(world * 300)
    dist.all_gather_into_tensor(want_g, shard)
    got_g = torch.full((world * 300,), float("nan"))
    start_gather_exchange(got_g, shard, dist.group.WORLD).wait(timeout=timedelta(seconds=60))
    assert torch.equal(got_g, want_g)
    got_g = torch.full((world * 300,), float("nan"))
    got_g[rank * 300:(rank + 1) * 300] = shard
    start_gather_exchange(got_g, got_g[rank * 300:(rank + 1) * 300], dist.group.WORLD).wait(
        timeout=timedelta(seconds=60))
    assert torch.equal(got_g, want_g)
    checked.append("gather")
    return checked


@pytest.mark.distributed
def test_two_level_collectives_equal_the_flat_ones():
    got = run_ranks(cases, 4, timeout=300)
    assert got == [["2x2", "4x1", "1x4", "pairs", "exchange", "gather"]] * 4


def test_unequal_nodes_are_refused_before_any_group_is_made():
    import pytest

    from pipezero.parallel.hierarchical import build_hierarchy

    with pytest.raises(ValueError, match="unequal members a node"):  # checked before any process group
        build_hierarchy([[0, 1, 2]], 2)


def test_hierarchical_split_problem_names_one_node_and_uneven_nodes():
    """With every replica of a stage on one node, the two-level reduction is the node's alone: the
    flag changed nothing (as --secondary-shard node, refused there). Uneven nodes were refused by
    every rank after the launch (build_hierarchy's ValueError); both are said before it."""
    from pipezero.config import ParallelConfig
    from pipezero.stage import hierarchical_split_problem

    one_node = hierarchical_split_problem(ParallelConfig(dp=2, hierarchical=True), 2)
    assert one_node is not None and "every replica of a stage on one node (2 ranks a node)" in one_node
    assert "drop it on one node" in one_node
    uneven = hierarchical_split_problem(ParallelConfig(dp=4, hierarchical=True), 3)
    assert uneven is not None and "(ranks a node, nodes) [(1, 2), (3, 2)]" in uneven
    assert hierarchical_split_problem(ParallelConfig(dp=4, hierarchical=True), 2) is None  # 2 nodes x 2
    assert hierarchical_split_problem(ParallelConfig(dp=4, hierarchical=True), 1) is None  # 4 nodes x 1
    assert hierarchical_split_problem(ParallelConfig(dp=2), 2) is None  # not asked for


def test_hierarchical_on_one_node_is_refused_before_torchrun(tmp_path, monkeypatch, capsys):
    from one_line import assert_one_line, run_main

    def no_launch(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("pipezero.launch.launch_local", no_launch)
    code, err = run_main(["train", "--preset", "tiny", "--tokenizer", "bytes", "--seq-len", "16", "--max-steps", "1",
                          "--no-progress", "--out", "o", "--dp", "2", "--nproc", "2", "--hierarchical"], capsys)
    assert_one_line(code, err, "--hierarchical with every replica of a stage on one node (2 ranks a node)")
    assert not (tmp_path / "o").exists()
