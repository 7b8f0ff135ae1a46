"""ZeRO-3 from a Hugging Face folder reads only each rank's shards: the runs equal one process
(losses and final parameters; layer by layer and kept gathered, tied and untied, frozen tensors,
buckets small enough that every shard cuts across tensor rows), and a rank's load reads about 1/D
of its chunk, exactly the bytes of its shard. One spawned group of 4 runs every case."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_models import hf_overrides, make_model
from pipezero.settings import build_config
from pipezero.verify import relative_error, with_tied_head

pytest.importorskip("transformers")

FREEZE = r"layers\.[0-2]\."  # the embedding and the first two blocks: loaded whole, not sharded
CASES = [  # (family, layout); microbatches 2 a replica, so the global batch is 2 D
    ("llama", {"parallel.pp": 1, "parallel.dp": 4, "parallel.zero3_keep_gathered": False}),
    ("llama-tied", {"parallel.pp": 1, "parallel.dp": 4, "parallel.zero3_keep_gathered": False}),
    ("llama", {"parallel.pp": 2, "parallel.dp": 2, "parallel.schedule": "1f1b"}),
    ("llama-tied", {"parallel.pp": 2, "parallel.dp": 2, "parallel.schedule": "zb-h1"}),
    ("llama", {"parallel.pp": 2, "parallel.dp": 2, "parallel.schedule": "1f1b", "optim.freeze": FREEZE}),
]


def _cfg(folder: str, data: str, out: str, case: dict):  # noqa: ANN202
    return build_config(None, hf_overrides(Path(folder), data, out, **{"parallel.zero": 3, **case}))


def train_and_load(rank: int, world: int, root: str, data: str, out: str) -> dict:
    """Each case's losses and final parameters; then, for P = 1, D = 4, the stage as built: how
    much its load read, and whether its master shards are the folder's flat ranges."""
    from safetensors.torch import load_file

    from pipezero.engine import train
    from pipezero.models.hf import to_hf
    from pipezero.stage import build_stage

    runs = []
    for i, (family, case) in enumerate(CASES):
        res = train(_cfg(f"{root}/{family}", data, f"{out}/{i}", case), snapshot=True)
        runs.append({"losses": res.losses, "params": res.params})
    loads = {}
    for family in ("llama", "llama-tied"):
        cfg = _cfg(f"{root}/{family}", data, f"{out}/load-{family}", CASES[0][1])
        stage = build_stage(cfg, rank)
        whole = load_file(f"{root}/{family}/model.safetensors")  # the test may read it all
        buckets = stage.zero.all_buckets()
        exact = all(torch.equal(b.master, torch.cat(
            [whole[to_hf(n, cfg.model.n_layers, cfg.model.tie_embeddings)].reshape(-1).float() for n in b.names]
            + [torch.zeros(b.padded - b.numel)])[b.shard]) for b in buckets)
        loads[family] = {"read": stage.zero.source.elements_read, "numel": sum(b.numel for b in buckets),
                         "exact": exact, "present": any(b.present for b in buckets),
                         "tensors": sum(len(b.names) for b in buckets)}
    return {"runs": runs, "loads": loads}


@pytest.mark.distributed
@pytest.mark.slow(28)
def test_zero3_reads_only_its_shards_and_trains_like_one_process(text_dir: Path, tmp_path: Path) -> None:
    from pipezero.engine import train
    from ranks import run_ranks

    root, data = tmp_path / "hf", str(text_dir)
    for family in ("llama", "llama-tied"):
        make_model(root / family, family)
    refs = {}  # one process, ZeRO-0, the same global batch (first: the ranks find the corpus cached)
    for family, case in CASES:
        key = (family, case.get("optim.freeze"), 2 * case["parallel.dp"])
        if key not in refs:
            cfg = build_config(None, hf_overrides(root / family, data, str(tmp_path / f"ref{len(refs)}"), **{
                "parallel.microbatches": key[2], **({"optim.freeze": key[1]} if key[1] else {})}))
            res = train(cfg, snapshot=True)
            refs[key] = (res.losses, res.params)
    per_rank = run_ranks(train_and_load, 4, str(root), data, str(tmp_path / "runs"), timeout=900)
    for rank, got in enumerate(per_rank):
        for (family, case), run in zip(CASES, got["runs"]):
            losses, params = refs[(family, case.get("optim.freeze"), 2 * case["parallel.dp"])]
            params = with_tied_head(params, _cfg(str(root / family), data, str(tmp_path / "unused"), case))
            assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(run["losses"], losses)), (rank, case, run, losses)
            assert run["params"], (rank, case)
            for name, value in run["params"].items():
                assert relative_error(value, params[name]) <= 1e-5, (rank, family, case, name)
        for family, load in got["loads"].items():
            # 1/4 of the chunk (the whole model at P = 1), plus at most the two rows of each tensor
            # that a shard's ends cut (48 elements the longest row); nothing gathered yet
            assert load["exact"] and not load["present"], (rank, family, load)
            assert load["read"] <= load["numel"] / 4 + 2 * 48 * load["tensors"], (rank, family, load)


def test_flat_ranges_cut_across_rows_and_shards_cover_a_bucket(tmp_path: Path) -> None:
    """FlatReader's range of a tensor is the flattened tensor's, wherever it starts and ends; the
    master shards of D = 3 buckets built from it are, laid end to end, the parameters' flat layout
    (with the padding zero), and the parameters themselves stay unallocated."""
    from safetensors.torch import load_file

    from pipezero.models import build_chunk
    from pipezero.models.chunk import place_hollow
    from pipezero.models.hf import to_hf
    from pipezero.models.hf_weights import FlatReader
    from pipezero.schedules.bucket_plan import group_tensors
    from pipezero.schedules.model_shapes import TensorShape
    from pipezero.zero.buckets import build_buckets, named_by_chunk

    folder = make_model(tmp_path / "tied", "llama-tied")
    cfg = build_config(None, {"model.pretrained": str(folder), "run.out": str(tmp_path / "out")}).model
    whole = {n: t.reshape(-1).float() for n, t in load_file(folder / "model.safetensors").items()}
    reader = FlatReader(cfg)
    gen = torch.Generator().manual_seed(0)
    for ours in ("layers.0.weight", "layers.3.mlp.w2.weight", "layers.8.norm.weight"):
        flat = whole[to_hf(ours, cfg.n_layers, cfg.tie_embeddings)]
        for _ in range(5):
            a, b = sorted(torch.randint(0, flat.numel() + 1, (2,), generator=gen).tolist())
            assert torch.equal(reader(ours, a, b).float(), flat[a:b]), (ours, a, b)
    chunk = build_chunk(cfg, 0, cfg.n_layers + 2, 0, "meta")
    place_hollow(chunk, "cpu")
    named = named_by_chunk({0: chunk})[0]
    layouts = group_tensors([TensorShape(n, tuple(q.shape)) for n, q in named], 0.01)
    shards = [build_buckets(layouts, named, 3, d, reader) for d in range(3)]
    for k, b in enumerate(shards[0]):
        laid = torch.cat([whole[to_hf(n, cfg.n_layers, cfg.tie_embeddings)] for n in b.names]
                         + [torch.zeros(b.padded - b.numel)])
        assert torch.equal(torch.cat([s[k].master for s in shards]), laid), b.names
        assert not b.present and all(q.untyped_storage().size() == 0 for q in b.params)
