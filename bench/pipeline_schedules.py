"""Time every pipeline schedule on one model and layout, beside torch.distributed.pipelining.

    python bench/pipeline_schedules.py [--preset small] [--n-layers N] [--pp 2] [--microbatches 8] [--steps 4]

Each rank runs with one torch thread. For each schedule, pipezero's executor and (where torch has
the same schedule) torch's `PipelineStage` + `Schedule*` run the same chunks on the same batches in
the same process group, every schedule's step in turn within each step (the first step dropped),
so the machine's drift hits them alike. Printed: step time, tokens/s, measured bubble (time a rank spent blocked on its peers over its step time, averaged
over ranks), the simulator's bubble at 1:1:1, the ratio to the ideal (P x the one-process,
one-thread throughput), and memory from one more, untimed step of ours: the most chunk activations a
rank held at once and the most bytes of tensors a rank allocated and held at once while it played
the schedule (the profiler's memory events: activations, what split backward keeps for W, gradients
in flight, temporaries; the model, its gradient buffers and the optimizer step are not counted),
the largest over ranks ("sched MiB"; each rank's in the JSON). The JSON also holds each rank's
minor page faults a step, ours and torch's: pages the heap gave back to the OS and a later step
faulted back in, which a wall-time ratio pays for without either runtime doing more work (see
`faults`). Results go to bench/results/pipeline_schedules/pipeline_schedules.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # rank_spawner.py

from pipezero.config import ScheduleKind as K  # noqa: E402
from pipezero.schedules.registry import default_virtual  # noqa: E402
from rank_spawner import run_ranks  # noqa: E402

TORCH_NAMES = {K.GPIPE: "ScheduleGPipe", K.ONE_F_ONE_B: "Schedule1F1B", K.INTERLEAVED_1F1B: "ScheduleInterleaved1F1B",
               K.LOOPED_BFS: "ScheduleLoopedBFS", K.ZB_H1: "ScheduleInterleavedZeroBubble",
               K.ZB_V: "ScheduleZBVZeroBubble", K.DUALPIPE_V: "ScheduleDualPipeV"}
V_OF = {kind: default_virtual(kind) for kind in K}


def config(args: argparse.Namespace, kind: K, pp: int):
    from pipezero.settings import build_config

    return build_config(None, {
        "model.preset": args.preset, **({"model.n_layers": args.n_layers} if args.n_layers else {}),
        "data.seq_len": args.seq_len, "data.tokenizer": "bytes",
        "data.max_bytes": 3_000_000, "parallel.pp": pp, "parallel.schedule": kind.value,
        "parallel.microbatches": args.microbatches, "parallel.micro_batch_size": args.micro_batch_size,
        "parallel.virtual_stages": V_OF.get(kind, 1) if pp > 1 else 1, "run.progress": False, "run.threads": 1,
        "run.save_final": False,
    })


def faults() -> int:
    """Minor page faults of this process so far. Pages a step frees may go back to the OS, as many
    as the heap's layout allows (not the runtime), and a later step faults them back in: gpipe's
    and looped-bfs's steps (270 MiB at their peak, after the other schedules' 60-115) fault up to
    ~26,000 pages a step (~100 MiB), ~95 ms at the ~3.6 us a fault measured on the 2-core VM
    under load (7% of a 1.3 s step), on ours or on torch's side as the layout falls, from run to
    run."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def cpu_peak_bytes(fn: Callable[[], object]) -> int:
    """Most bytes of CPU tensors alive at once while `fn` runs, counting only what it allocated
    (the profiler's memory events, as a run's --memory-profile counts them)."""
    import torch

    from pipezero.telemetry.memory_profile import PeakMeter

    with PeakMeter(torch.device("cpu")) as meter:
        fn()
    return meter.peak_bytes


def pipezero_step(cfg, rank: int):
    """One training step of pipezero's runtime as a function of the step's micro-batches."""
    from pipezero.stage import build_stage

    stage = build_stage(cfg, rank)
    denom = cfg.global_batch * cfg.data.seq_len

    def step(mbs: list, measure: Callable | None = None) -> tuple[float, float, int, int | None]:
        """(seconds, measured bubble, peak live chunk activations, and with `measure` (such as
        cpu_peak_bytes) its figure for the schedule alone, the optimizer step left out)."""
        stage.zero.begin_step()
        t0 = time.perf_counter()
        ran: list = []
        held = measure(lambda: ran.append(stage.executor.run(stage.program, mbs, denom))) if measure else None
        stats = ran[0] if measure else stage.executor.run(stage.program, mbs, denom)
        stage.zero.step(1e-4, 1.0, stage.groups.world)
        return time.perf_counter() - t0, stats.wait_s / stats.elapsed_s, stats.peak_live, held
    return step


def torch_step(cfg, rank: int, kind: K):
    """The same step on torch.distributed.pipelining (same chunks, init and optimizer), or None."""
    import torch
    import torch.distributed.pipelining as tpp
    from pipezero.stage import build_stage
    from pipezero.models import lm_loss

    if kind not in TORCH_NAMES:
        return None
    stage = build_stage(cfg, rank)  # same chunks, same init; only the schedule runtime differs
    n_chunks = stage.schedule.n_chunks
    denom = cfg.global_batch * cfg.data.seq_len / cfg.parallel.microbatches  # torch averages micro-batches
    b, t, d = cfg.parallel.micro_batch_size, cfg.data.seq_len, cfg.model.dim
    stages = []
    for c, chunk in sorted(stage.chunks.items()):
        example = torch.zeros(b, t, dtype=torch.long) if c == 0 else torch.zeros(b, t, d)
        stages.append(tpp.PipelineStage(chunk, c, n_chunks, torch.device("cpu"), input_args=(example,)))
    cls = getattr(tpp, TORCH_NAMES[kind])
    loss_fn = lambda out, tgt: lm_loss(out, tgt, denom)  # noqa: E731
    single_stage = cls in (tpp.Schedule1F1B, tpp.ScheduleGPipe)
    sched = cls(stages[0] if single_stage else stages, n_microbatches=cfg.parallel.microbatches, loss_fn=loss_fn)
    holds_first = 0 in stage.chunks
    holds_last = n_chunks - 1 in stage.chunks

    def step(mbs: list) -> float:
        x = torch.cat([m[0] for m in mbs])
        y = torch.cat([m[1] for m in mbs])
        t0 = time.perf_counter()
        kwargs = {"target": y, "losses": []} if holds_last else {}
        sched.step(*([x] if holds_first else []), **kwargs)
        stage.zero.begin_step()
        stage.zero.step(1e-4, 1.0, stage.groups.world)
        return time.perf_counter() - t0
    return step


def bench_rank(rank: int, world: int, args: argparse.Namespace, kinds: list) -> dict:
    """Every schedule's step, ours and torch's, in turn within each step (every stage built first),
    so the machine's drift over the run hits every schedule alike; the first step is dropped."""
    import torch.distributed as dist

    from pipezero.data import global_batch, load_corpus, microbatches_for_rank

    players: dict = {}  # kind -> [ours, theirs or None, torch's error or None]
    for kind in kinds:
        cfg = config(args, kind, world)
        try:
            theirs_step, err = torch_step(cfg, rank, kind), None
        except Exception as e:  # noqa: BLE001 - report, do not hide, a torch schedule that fails here
            theirs_step, err = None, f"{type(e).__name__}: {str(e)[:200]}"
        players[kind] = [pipezero_step(cfg, rank), theirs_step, err]
    corpus = load_corpus(cfg.data)  # the same batches whatever the schedule (only the layout differs)
    batches = [microbatches_for_rank(global_batch(corpus.train, s, 0, cfg.global_batch, cfg.data.seq_len), 0, 1,
                                     cfg.parallel.microbatches) for s in range(args.steps + 1)]
    out = {kind.value: {"ours": [], "bubble": [], "torch": [], "ours_faults": [], "torch_faults": []}
           for kind in kinds}
    for mbs in batches:
        for kind, player in players.items():
            row = out[kind.value]
            dist.barrier()
            f0 = faults()
            t, b, _, _ = player[0](mbs)
            row["ours_faults"].append(faults() - f0)
            row["ours"].append(t)
            row["bubble"].append(b)
            if player[1] is not None:
                dist.barrier()
                try:
                    f0 = faults()
                    row["torch"].append(player[1](mbs))
                    row["torch_faults"].append(faults() - f0)
                except Exception as e:  # noqa: BLE001
                    player[1], row["torch"], player[2] = None, [], f"{type(e).__name__}: {str(e)[:200]}"
    for kind, (ours_step, _, err) in players.items():
        dist.barrier()
        _, _, live, step_bytes = ours_step(batches[-1], cpu_peak_bytes)  # untimed: the profiler slows it
        row = out[kind.value]
        out[kind.value] = {"ours": row["ours"][1:], "bubble": row["bubble"][1:],
                           "torch": row["torch"][1:] if row["torch"] else None, "torch_error": err,
                           "peak_live": live, "step_peak_bytes": step_bytes, "ours_faults": row["ours_faults"][1:],
                           "torch_faults": row["torch_faults"][1:] if row["torch"] else None}
    return out


def one_process_tokens_per_s(args: argparse.Namespace) -> float:
    import torch

    from pipezero.data import global_batch, load_corpus, microbatches_for_rank
    from pipezero.stage import build_stage

    torch.set_num_threads(1)
    cfg = config(args, K.ONE_F_ONE_B, 1)
    stage = build_stage(cfg, 0)
    corpus = load_corpus(cfg.data)
    times = []
    for s in range(args.steps + 1):
        mbs = microbatches_for_rank(global_batch(corpus.train, s, 0, cfg.global_batch, cfg.data.seq_len), 0, 1,
                                    cfg.parallel.microbatches)
        stage.zero.begin_step()
        t0 = time.perf_counter()
        stage.executor.run(stage.program, mbs, cfg.global_batch * cfg.data.seq_len)
        stage.zero.step(1e-4, 1.0, None)
        times.append(time.perf_counter() - t0)
    return cfg.global_batch * cfg.data.seq_len / (sum(times[1:]) / args.steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--n-layers", type=int, default=None, help="the preset's blocks unless given (2P chunks of V "
                    "schedules are even when the blocks plus embedding and head divide by 2P)")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--schedules", default=",".join(k.value for k in K))
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).parent / "results" / "pipeline_schedules" / "pipeline_schedules.json")
    args = ap.parse_args()
    kinds = [K(s) for s in args.schedules.split(",")]
    from pipezero.schedules.check import simulate
    from pipezero.schedules.registry import build_schedule

    single = one_process_tokens_per_s(args)
    ideal = args.pp * single
    per_rank = run_ranks(bench_rank, args.pp, args, kinds, timeout=3000, threads=1)
    tokens = args.microbatches * args.micro_batch_size * args.seq_len
    rows = {}
    print(f"{args.preset}, P={args.pp}, M={args.microbatches}, B={args.micro_batch_size}, T={args.seq_len}, 1 thread a rank;"
          f" one process: {single:,.0f} tok/s, ideal P x that: {ideal:,.0f} tok/s")
    print(f"{'schedule':18}{'step s':>8}{'tok/s':>9}{'vs ideal':>9}{'bubble':>8}{'sim':>7}{'live':>6}{'sched MiB':>10}"
          f"{'torch s':>9}{'torch tok/s':>12}{'ours/torch':>11}")
    for kind in kinds:
        step = max(sum(r[kind.value]["ours"]) / args.steps for r in per_rank)
        bubble = sum(sum(r[kind.value]["bubble"]) / args.steps for r in per_rank) / args.pp
        sim = simulate(build_schedule(kind, args.pp, args.microbatches, V_OF.get(kind, 1))).bubble
        live = max(r[kind.value]["peak_live"] for r in per_rank)
        step_mib = max(r[kind.value]["step_peak_bytes"] for r in per_rank) / 2**20
        t = per_rank[0][kind.value]["torch"]
        tstep = max(sum(r[kind.value]["torch"]) / args.steps for r in per_rank) if t else None
        rows[kind.value] = {"step_s": step, "tokens_per_s": tokens / step, "vs_ideal": tokens / step / ideal,
                            "measured_bubble": bubble, "simulated_bubble": sim,
                            "peak_live_activations": live, "schedule_peak_mib": step_mib,
                            "schedule_peak_bytes_per_rank": [r[kind.value]["step_peak_bytes"] for r in per_rank],
                            "torch_step_s": tstep, "torch_tokens_per_s": tokens / tstep if tstep else None,
                            "ours_over_torch_throughput": tstep / step if tstep else None,
                            "torch_error": per_rank[0][kind.value]["torch_error"],
                            "page_faults_per_step_by_rank": {
                                side: [sum(f) / len(f) if f else None for f in
                                       (r[kind.value][f"{side}_faults"] for r in per_rank)]
                                for side in ("ours", "torch")}}
        r = rows[kind.value]
        tcol = f"{tstep:9.3f}{tokens / tstep:12,.0f}{tstep / step:11.2f}" if tstep else f"{'-':>9}{'-':>12}{'-':>11}"
        print(f"{kind.value:18}{step:8.3f}{tokens / step:9,.0f}{r['vs_ideal']:9.2f}{bubble:8.1%}{sim:7.1%}{live:6d}"
              f"{step_mib:10.1f}{tcol}")
        if r["torch_error"]:
            print(f"    torch: {r['torch_error']}")
    out = args.out
    out.parent.mkdir(exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"args": {**vars(args), "out": str(out)}, "one_process_tokens_per_s": single,
                               "ideal_tokens_per_s": ideal, "schedules": rows}, indent=2))
    tmp.replace(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
