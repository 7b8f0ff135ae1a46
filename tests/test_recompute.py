"""--recompute (runtime/recompute.py): every block's forward runs again inside its own backward, and
the run trains exactly the model its plain run trains: the rerun computes the same tensors with the
same kernels, so losses and weights are equal bit for bit, under every way a backward is played."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipezero.config import ScheduleKind as K
from ranks import run_ranks
from training import train_cases

LAYERWISE = {"parallel.zero": 3, "parallel.zero3_keep_gathered": False}
# each layout once plain, once recomputed, in one spawn of four ranks
CASES = [
    # ZeRO-3 layer by layer: a block's bucket, gathered at its `bwd`, serves the rerun; with its parts
    # gathered apart the rerun's own moments gather the attention (schedules/layer_plan.py), before
    # any of the block's `bwd` where its MLP is frozen (no hooks: the rerun starts there)
    {"pp": 1, "dp": 4, "kind": K.ONE_F_ONE_B, "m": 2, **LAYERWISE, "parallel.zero3_prefetch": 2},
    {"pp": 1, "dp": 4, "kind": K.GPIPE, "m": 2, **LAYERWISE, "parallel.zero3_unit": "sublayer",
     "optim.freeze": r"layers\.2\.mlp|layers\.3\.attn"},
    # split backward: B and W each rerun the blocks (no stash with recompute); ZeRO-3 layer by layer
    # over a V placement
    {"pp": 2, "dp": 2, "kind": K.ZB_H1, "m": 4, "parallel.zero": 2},
    {"pp": 2, "dp": 2, "kind": K.ZB_V, "m": 4, **LAYERWISE},
    # offloaded optimizer state, and bf16 autocast (the rerun casts the weights again, uncached)
    {"pp": 2, "dp": 2, "kind": K.ONE_F_ONE_B, "m": 4, "parallel.zero": 1, "parallel.offload": "optimizer",
     "run.dtype": "bf16"},
]


def train_pairs(rank: int, world: int, data: str, out: str, cases: list[dict]) -> list[tuple[dict, dict]]:
    pairs = []
    for i, case in enumerate(cases):
        plain, again = train_cases(rank, world, data, f"{out}/case{i}",
                                   [case, {**case, "parallel.recompute": True}])
        pairs.append((plain, again))
    return pairs


@pytest.mark.distributed
def test_recomputed_runs_equal_their_plain_runs_bit_for_bit(text_dir, tmp_path):
    results = run_ranks(train_pairs, 4, str(text_dir), str(tmp_path), CASES, timeout=600)
    for rank, per_rank in enumerate(results):
        for plain, again in per_rank:
            where = (rank, again["case"])
            assert again["losses"] == plain["losses"], where
            assert again["params"].keys() == plain["params"].keys() and plain["params"], where
            for name, w in again["params"].items():
                assert torch.equal(w, plain["params"][name]), (*where, name)


def saved_bytes_and_grads(recompute: bool) -> tuple[int, int, dict]:
    """A tiny whole model's forward and backward on one process: the bytes autograd keeps outside any
    checkpoint, how many block forwards ran, and the gradients."""
    from pipezero.config import ModelConfig
    from pipezero.models import apply_preset, build_chunk
    from pipezero.runtime.recompute import checkpoint_blocks

    cfg = dataclasses.replace(apply_preset(ModelConfig(), "tiny"), n_layers=3, dim=32, n_heads=4, vocab_size=64)
    chunk = build_chunk(cfg, 0, cfg.n_layers + 2, seed=0)
    runs = [0]
    for index, layer in chunk.layer_modules():
        if chunk.is_block(index):
            layer.register_forward_pre_hook(lambda *_: runs.__setitem__(0, runs[0] + 1))
            inner = layer.forward
            layer.forward = lambda *a, f=inner: (runs.__setitem__(0, runs[0] + 1), f(*a))[1]
    if recompute:
        checkpoint_blocks(chunk)
    kept = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[0] += t.numel() * t.element_size()
        return t

    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = chunk(tokens)
    logits.float().logsumexp(-1).mean().backward()
    return kept[0], runs[0], {n: p.grad for n, p in chunk.named_parameters()}


def test_a_recomputed_block_keeps_only_its_input_and_runs_its_forward_again_in_backward():
    """In forward a checkpointed block saves nothing of its own (autograd outside the checkpoints
    keeps the embedding's and the head's tensors and each block's input); each block's forward runs
    twice (the module's hooks once: they sit outside the checkpoint); the gradients are the plain ones."""
    plain_bytes, plain_runs, plain = saved_bytes_and_grads(False)
    bytes_, runs, grads = saved_bytes_and_grads(True)
    assert plain_runs == 2 * 3 and runs == 2 * 3 + 3  # hooks and forwards: 3 blocks; 3 reruns of the forward alone
    assert bytes_ < plain_bytes / 3
    assert grads.keys() == plain.keys() and all(torch.equal(grads[n], plain[n]) for n in grads)
