"""Flat against two-level (inside a node, then across nodes) gradient collectives on the emulated cluster.

    python bench/cluster_hierarchical.py [--rates 100mbit,500mbit] [--sizes-mb 1,4,25] [--reps 3] [--per-node 2]

(as root). 2 nodes x 2 ranks, one group of all 4 ranks (D=4 across nodes), so each node's uplink
carries the traffic of both its ranks (`--per-node 1`: D=2, one rank a node). For each bucket size, every rank times:
  flat all-reduce          dist.all_reduce (gloo's ring over ranks 0-1-2-3: what ZeRO-0/1 run);
  two-level all-reduce     parallel/hierarchical.py: reduce-scatter in the node, all-reduce of the
                           half across nodes, all-gather in the node;
  flat reduce-scatter      dist.reduce_scatter_tensor (what ZeRO-2/3 run; gloo sends an
                           all-reduce's bytes for it);
  flat exchange RS         the same sum by one all_to_all_single over all 4 ranks and a local sum:
                           the control that separates the exchange from the hierarchy;
  two-level reduce-scatter hierarchical.reduce_scatter: an exchange in the node, then across.
Each figure is the best over --reps of the slowest rank's time (variants interleaved within each
repetition, so the host's load falls on all of them alike); `wire` is the bytes a node's uplink
must carry over the link rate, the floor each variant could reach. The rate `local` runs every
rank in one namespace (no shaped link): what the extra steps cost in CPU and memory alone.
Writes bench/results/cluster_hierarchical/cluster_hierarchical.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

RESULTS = Path(__file__).resolve().parent / "results" / "cluster_hierarchical"


def uplink_share(variant: str, nodes: int, per_node: int) -> float:
    """Bytes a node's uplink carries, as a multiple of the bucket, with ranks in node order: a flat
    ring crosses each node boundary once, carrying what one rank sends (2 (W - 1) / W; gloo's
    reduce-scatter is an all-reduce's bytes); a flat exchange sends a 1/W slice from every rank of
    the node to every rank of another; the two-level forms send one 1/N piece a rank across."""
    w, k, n = nodes * per_node, nodes, per_node
    return {"flat all-reduce": 2 * (w - 1) / w, "two-level all-reduce": 2 * (k - 1) / k,
            "flat reduce-scatter": 2 * (w - 1) / w, "flat exchange RS": n * (k - 1) / k,
            "two-level reduce-scatter": (k - 1) / k}[variant]


def worker(sizes_mb: list[float], reps: int, per_node: int) -> None:
    """Under torchrun (4 ranks): time every variant at every size; rank 0 prints the JSON."""
    import torch
    import torch.distributed as dist

    from pipezero.parallel.hierarchical import all_reduce, build_hierarchy, reduce_scatter

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    everyone = [list(range(world))]
    two_level = build_hierarchy(everyone, per_node)
    one_level = build_hierarchy(everyone, world)  # one "node" of every rank: the flat exchange
    assert two_level is not None and one_level is not None

    def variants(buf: torch.Tensor, out: torch.Tensor) -> dict:
        return {"flat all-reduce": lambda: dist.all_reduce(buf),
                "two-level all-reduce": lambda: all_reduce(buf, two_level),
                "flat reduce-scatter": lambda: dist.reduce_scatter_tensor(out, buf),
                "flat exchange RS": lambda: reduce_scatter(out, buf, one_level),
                "two-level reduce-scatter": lambda: reduce_scatter(out, buf, two_level)}

    rows = []
    for mb in sizes_mb:
        n = int(mb * 2**20 / 4) // world * world
        buf, out = torch.ones(n), torch.empty(n // world)
        fns = variants(buf, out)
        best = {k: float("inf") for k in fns}
        for rep in range(reps + 1):  # the first round warms up connections and allocations
            for name, fn in fns.items():
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                took = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                if rep:
                    best[name] = min(best[name], took.item())
        rows += [{"size_mb": mb, "bytes": n * 4, "variant": k, "seconds": v} for k, v in best.items()]
    if rank == 0:
        print(json.dumps(rows), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads can abort an orderly interpreter exit


def measure(args: argparse.Namespace) -> list[dict]:
    from cluster_overlap import on_cluster, rate_bytes_per_s

    rows = []
    for rate in args.rates.split(","):
        nodes, per_node, link = (1, 2 * args.per_node, "10gbit") if rate == "local" else (2, args.per_node, rate)
        said = on_cluster(nodes, per_node, link, [str(Path(__file__).resolve()), "--worker", "--sizes-mb",
                                                  args.sizes_mb, "--reps", str(args.reps), "--per-node",
                                                  str(args.per_node)], timeout=1800)
        got = json.loads(said.strip().splitlines()[-1])
        for r in got:
            share = uplink_share(r["variant"], 2, args.per_node)
            wire = None if rate == "local" else share * r["bytes"] / rate_bytes_per_s(rate)
            rows.append({"link": rate, "nodes": 2, "per_node": args.per_node, **r, "uplink_share": share,
                         "wire_s": wire})
        print(table([r for r in rows if r["link"] == rate]), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    """One markdown table: a row a size and variant, with the ratio to its flat counterpart."""
    flat = {(r["size_mb"], r["variant"].split()[-1]): r["seconds"] for r in rows if r["variant"].startswith("flat ")
            and "exchange" not in r["variant"]}
    lines = ["| link | bucket MiB | variant | s | wire floor s | flat / this |", "|---|---|---|---|---|---|"]
    for r in rows:
        kind = "all-reduce" if "all-reduce" in r["variant"] else "reduce-scatter"
        base = flat[(r["size_mb"], kind)]
        wire = "" if r["wire_s"] is None else f"{r['wire_s']:.3f}"
        lines.append(f"| {r['link']} | {r['size_mb']:g} | {r['variant']} | {r['seconds']:.3f} | {wire} | "
                     f"{base / r['seconds']:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="100mbit,500mbit", help="link rates; `local`: all ranks in one namespace")
    ap.add_argument("--sizes-mb", default="1,4,25")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--per-node", type=int, default=2, help="ranks a node (2 nodes); 1: D=2, one rank a node, where "
                    "the two-level forms are the flat ones and only the exchange differs")
    ap.add_argument("--name", default="cluster_hierarchical")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker([float(x) for x in args.sizes_mb.split(",")], args.reps, args.per_node)
        return
    rows = measure(args)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {RESULTS / args.name}.json")


if __name__ == "__main__":
    main()
