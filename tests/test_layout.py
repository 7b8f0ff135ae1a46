"""Mesh and partition are values: tested with no processes."""

import pytest

from pipezero.config import ModelConfig, Partition
from pipezero.models import apply_preset
from pipezero.parallel.mesh import Mesh
from pipezero.models.presets import layer_costs
from pipezero.parallel.partition import balanced_cuts, partition


def test_mesh_positions_and_groups():
    m = Mesh(pp=4, dp=2, rank=5)
    assert (m.pp_rank, m.dp_rank) == (2, 1)
    assert m.pp_ranks() == [1, 3, 5, 7] and m.dp_ranks() == [4, 5]
    with pytest.raises(ValueError):
        Mesh(2, 2, rank=4)


def test_pp_inner_placement_puts_a_pipeline_on_neighbouring_ranks():
    from pipezero.config import Placement

    m = Mesh(pp=2, dp=2, rank=1, placement=Placement.PP_INNER)  # 2 nodes x 2: node 0 holds ranks 0, 1
    assert (m.pp_rank, m.dp_rank) == (1, 0)
    assert m.pp_ranks() == [0, 1] and m.dp_ranks() == [1, 3]  # activations inside, gradients across
    assert [Mesh(2, 2, r, Placement.PP_INNER).global_rank(*divmod(r, 2)[::-1]) for r in range(4)] == [0, 1, 2, 3]


def test_partition_policies():
    cfg = apply_preset(ModelConfig(), "small")  # embedding + 8 blocks + head = 10 layers
    uniform = partition(cfg, 4, Partition.UNIFORM, 128)
    assert [b - a for a, b in uniform] == [3, 3, 2, 2] and uniform[-1][1] == 10
    cost = partition(cfg, 4, Partition.COST, 128)
    weights = layer_costs(cfg, 128)
    heaviest = max(sum(weights[a:b]) for a, b in cost)
    assert heaviest <= max(sum(weights[a:b]) for a, b in uniform)
    assert partition(cfg, 3, Partition.UNIFORM, 128, explicit=[1, 8, 1]) == [(0, 1), (1, 9), (9, 10)]


def test_balanced_cuts_exact_count_and_optimal():
    assert balanced_cuts([1, 1, 1, 1], 4) == [1, 1, 1, 1]
    assert balanced_cuts([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    counts = balanced_cuts([1.0] * 10, 3)
    assert sum(counts) == 10 and len(counts) == 3 and max(counts) == 4
    with pytest.raises(ValueError):
        balanced_cuts([1, 1], 3)
