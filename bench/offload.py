"""What offload costs on this machine: step time with and without --offload optimizer (each ZeRO
stage) and --offload-activations, the traced time of the host copies and host steps, and where each
rank's optimizer bytes live.

    python bench/offload.py [--preset small] [--microbatches 4] [--steps 6]

Two ranks, one thread each, in one process group: P=1 x D=2 at ZeRO 0-3, each plain then with
--offload optimizer; then P=2 x D=1 1F1B plain and with --offload-activations 2 (ZeRO-0). On a CPU
rank "host" and "device" are one memory, so the copies are memory copies and the host's AdamW is the
same kernel the device ran: what this measures is the price of the instructions themselves (the
copies, a step a bucket), not PCIe; a GPU's figures come from bench/gpu_session.sh.
Writes bench/results/offload/offload.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # rank_spawner.py

from rank_spawner import run_ranks  # noqa: E402

HOST_SPANS = ("OFFLOAD_GRAD", "HOST_STEP", "OFFLOAD_ACT", "RELOAD_ACT")


def config(args: argparse.Namespace, pp: int, dp: int, zero: int, **extra: object):
    from pipezero.settings import build_config

    return build_config(None, {
        "model.preset": args.preset, "data.seq_len": args.seq_len, "data.tokenizer": "bytes",
        "data.max_bytes": 3_000_000, "parallel.pp": pp, "parallel.dp": dp, "parallel.zero": zero,
        "parallel.microbatches": args.microbatches, "parallel.micro_batch_size": args.micro_batch_size,
        "run.progress": False, "run.threads": 1, "run.trace": True, "run.save_final": False, **extra})


def time_layout(args: argparse.Namespace, rank: int, pp: int, dp: int, zero: int, **extra: object) -> dict:
    from pipezero.data import global_batch, load_corpus, microbatches_for_rank
    from pipezero.stage import build_stage

    cfg = config(args, pp, dp, zero, **extra)
    stage = build_stage(cfg, rank)
    corpus = load_corpus(cfg.data)
    denom = cfg.global_batch * cfg.data.seq_len
    times, host = [], []
    for step in range(args.steps):
        mbs = microbatches_for_rank(global_batch(corpus.train, step, 0, cfg.global_batch, cfg.data.seq_len),
                                    stage.mesh.dp_rank, dp, cfg.parallel.microbatches)
        stage.tracer.step = step
        stage.zero.begin_step()
        t0 = time.perf_counter()
        stage.executor.run(stage.program, mbs, denom, lambda loss: stage.zero.step(1e-4, 1.0, stage.groups.world))
        times.append(time.perf_counter() - t0)
        host.append({k: sum(e[4] - e[3] for e in stage.tracer.events if e[5] == step and e[0].startswith(k))
                     for k in HOST_SPANS})
    z = stage.zero
    return {"step_s": statistics.fmean(times[1:]),
            "host_s": {k: statistics.fmean(h[k] for h in host[1:]) for k in HOST_SPANS},
            "device_optimizer_bytes": 0 if z.host else z.opt.state_bytes(),
            "host_optimizer_bytes": z.host.host_bytes() if z.host else 0}


def bench_rank(rank: int, world: int, args: argparse.Namespace) -> dict:
    out = {}
    for zero in (0, 1, 2, 3):
        for offload in ("none", "optimizer"):
            out[f"dp2 zero{zero} {offload}"] = time_layout(args, rank, 1, 2, zero, **{"parallel.offload": offload})
    for n in (0, 2):
        out[f"pp2 1f1b activations {n}"] = time_layout(args, rank, 2, 1, 0, **{"parallel.offload_activations": n})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    from pipezero.errors import ConfigError

    try:  # a bad preset or size is said once, before any rank starts
        config(args, 1, 2, 0, **{"parallel.offload": "optimizer"})
        config(args, 2, 1, 0, **{"parallel.offload_activations": 2})
    except ConfigError as e:
        ap.error(str(e))
    per_rank = run_ranks(bench_rank, 2, args, timeout=3000, threads=1)
    print(f"{args.preset}, M={args.microbatches}, B={args.micro_batch_size}, T={args.seq_len}, 2 ranks, 1 thread "
          f"each, mean of steps 2-{args.steps}")
    print(f"{'run':30}{'step s':>8}{'vs plain':>9}{'host work s':>12}{'optim MiB dev':>14}{'host':>7}")
    rows, plain = {}, {}
    for name in per_rank[0]:
        step = max(r[name]["step_s"] for r in per_rank)
        hosted = max(sum(r[name]["host_s"].values()) for r in per_rank)
        dev = max(r[name]["device_optimizer_bytes"] for r in per_rank) / 2**20
        host = max(r[name]["host_optimizer_bytes"] for r in per_rank) / 2**20
        base = name.rsplit(" ", 1)[0]
        if name.endswith((" none", " 0")):
            plain[base] = step
        ratio = step / plain[base]
        rows[name] = {"step_s": step, "step_over_plain": ratio, "host_work_s": hosted,
                      "host_work_by_kind_s": {k: max(r[name]["host_s"][k] for r in per_rank) for k in HOST_SPANS},
                      "device_optimizer_mib": dev, "host_optimizer_mib": host}
        print(f"{name:30}{step:8.3f}{ratio:9.2f}{hosted:12.4f}{dev:14.2f}{host:7.2f}")
    out = Path(__file__).parent / "results" / "offload" / "offload.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "runs": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
