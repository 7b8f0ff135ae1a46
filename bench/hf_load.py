"""Loading a Hugging Face checkpoint: per-rank peak memory and time, pipezero at P = 1 and P = 4
(and ZeRO-3 at P = 1, D = 4) beside transformers' from_pretrained in one process.

    python bench/hf_load.py [--layers 32 --dim 1024 --ffn 2816 --vocab 32000] [--dtype bf16] [--shard 500MB]

Generates a random Llama (default ~0.48B parameters, bf16 on disk as published checkpoints are,
in shards with an index) with transformers' save_pretrained into a temporary folder, then in fresh
processes: transformers loads it whole (fp32), and pipezero's ranks of P = 1 and P = 4 each build
their stage chunks and read only their tensors (models/hf_weights.py), fp32 as pipezero trains;
ZeRO-3's ranks of P = 1, D = 4 each read only their 1/4 shard of every bucket (zero/buckets.py).
Reported per process: resident memory before loading (imports), the peak after (ru_maxrss), the
difference, the bytes of the parameters it holds, and seconds. Writes bench/results/hf_load/hf_load.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # rank_spawner.py

from rank_spawner import run_ranks  # noqa: E402

MIB = 2**20


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def generate(rank: int, world: int, folder: str, shape: dict, dtype: str, shard: str) -> int:
    """A random Llama saved with save_pretrained (in a process of its own: its memory is not measured)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipezero.data.tokenizer import BPETokenizer

    config = LlamaConfig(**shape, tie_word_embeddings=False, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to({"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])
    model.save_pretrained(folder, max_shard_size=shard)
    BPETokenizer.train(["def f(x):\n    return x + 1\n" * 50], 300, eos=True).hf.save(f"{folder}/tokenizer.json")
    return sum(p.numel() for p in model.parameters())


def load_transformers(rank: int, world: int, folder: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    base, t0 = rss_now(), time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    seconds = time.perf_counter() - t0
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"base_mib": base / MIB, "peak_mib": peak() / MIB, "delta_mib": (peak() - base) / MIB,
            "params_mib": held / MIB, "seconds": seconds}


def load_pipezero(rank: int, world: int, folder: str) -> dict:
    """What stage.build_stage does for the weights: this rank's chunks, built and read."""
    from pipezero.settings import build_config
    from pipezero.models import build_chunk
    from pipezero.models.hf_weights import load_chunk
    from pipezero.parallel.partition import partition
    from pipezero.schedules.registry import build_schedule

    base, t0 = rss_now(), time.perf_counter()
    cfg = build_config(None, {"model.pretrained": folder, "parallel.pp": world, "run.out": "/tmp/unused"})
    check_s = time.perf_counter() - t0  # config.json, tokenizer and every safetensors header
    p = cfg.parallel
    schedule = build_schedule(p.schedule, p.pp, p.microbatches, p.virtual_stages)
    bounds = partition(cfg.model, schedule.n_chunks, p.partition, cfg.data.seq_len, p.stage_layers)
    held = 0
    for c in schedule.chunks(rank):
        chunk = build_chunk(cfg.model, *bounds[c], cfg.run.seed)
        load_chunk(chunk, cfg.model)
        held += sum(q.numel() * q.element_size() for q in chunk.parameters())
    seconds = time.perf_counter() - t0
    return {"base_mib": base / MIB, "peak_mib": peak() / MIB, "delta_mib": (peak() - base) / MIB,
            "params_mib": held / MIB, "seconds": seconds, "check_s": check_s,
            "layers": [list(bounds[c]) for c in schedule.chunks(rank)]}


def load_pipezero_zero3(rank: int, world: int, folder: str) -> dict:
    """What stage.build_stage does for the weights at ZeRO-3, P = 1, D = world: the whole model's
    chunk on the meta device, and this data-parallel rank's shard of each bucket read."""
    from pipezero.settings import build_config
    from pipezero.models import build_chunk
    from pipezero.models.chunk import place_hollow
    from pipezero.models.hf_weights import FlatReader
    from pipezero.schedules.bucket_plan import group_tensors
    from pipezero.schedules.model_shapes import TensorShape
    from pipezero.zero.buckets import build_buckets, named_by_chunk

    base, t0 = rss_now(), time.perf_counter()
    cfg = build_config(None, {"model.pretrained": folder, "parallel.dp": world, "parallel.zero": 3,
                              "run.out": "/tmp/unused"})
    check_s = time.perf_counter() - t0
    chunk = build_chunk(cfg.model, 0, cfg.model.n_layers + 2, cfg.run.seed, "meta")
    place_hollow(chunk, "cpu")
    reader = FlatReader(cfg.model)
    named = named_by_chunk({0: chunk})[0]
    layouts = group_tensors([TensorShape(n, tuple(q.shape)) for n, q in named], cfg.parallel.bucket_mb)  # the plan's
    buckets = build_buckets(layouts, named, world, rank, reader)
    held = sum(b.master.numel() * b.master.element_size() for b in buckets)
    seconds = time.perf_counter() - t0
    return {"base_mib": base / MIB, "peak_mib": peak() / MIB, "delta_mib": (peak() - base) / MIB,
            "params_mib": held / MIB, "seconds": seconds, "check_s": check_s,
            "read_mib": reader.elements_read * 4 / MIB}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="dtype on disk")
    ap.add_argument("--shard", default="500MB", help="save_pretrained's max_shard_size")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "hf_load" / "hf_load.json"))
    args = ap.parse_args()
    shape = dict(num_hidden_layers=args.layers, hidden_size=args.dim, intermediate_size=args.ffn,
                 vocab_size=args.vocab, num_attention_heads=args.dim // 64, num_key_value_heads=args.dim // 64)
    with tempfile.TemporaryDirectory() as tmp:
        folder = f"{tmp}/model"
        (params,) = run_ranks(generate, 1, folder, shape, args.dtype, args.shard, timeout=1800)
        disk = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))
        print(f"random Llama: {params / 1e9:.3f}B parameters, {disk / MIB:,.0f} MiB of {args.dtype} safetensors "
              f"in {len(list(Path(folder).glob('*.safetensors')))} shards")
        rows = {"transformers": run_ranks(load_transformers, 1, folder, timeout=1800)}
        for world in (1, 4):
            rows[f"pipezero P={world}"] = run_ranks(load_pipezero, world, folder, timeout=1800)
        rows["ZeRO-3 P=1 D=4"] = run_ranks(load_pipezero_zero3, 4, folder, timeout=1800)
    print(f"{'loader':<16} {'rank':>4} {'params MiB':>10} {'base MiB':>9} {'peak MiB':>9} {'peak-base':>9} {'seconds':>8}")
    for name, ranks in rows.items():
        for r, x in enumerate(ranks):
            print(f"{name:<16} {r:>4} {x['params_mib']:>10,.0f} {x['base_mib']:>9,.0f} {x['peak_mib']:>9,.0f} "
                  f"{x['delta_mib']:>9,.0f} {x['seconds']:>8.1f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"params": params, "disk_bytes": disk, "shape": shape, "dtype_on_disk": args.dtype,
                                          "results": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
