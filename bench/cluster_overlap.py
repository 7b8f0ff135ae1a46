"""How much communication hides behind compute on the emulated cluster, at several link rates.

    python bench/cluster_overlap.py [--rates 50mbit,200mbit,1gbit] [--layouts dp,pp] [--steps 8]

(as root). Every layout runs on 2 nodes x 1 rank, so all of its traffic crosses the shaped link:
data parallel D=2 at ZeRO 0-3, and pipeline P=2 with 1F1B, ZB-H1 and interleaved 1F1B (V=2). For
each layout:
  compute-only  the step time with both ranks on one node (loopback, unshaped): what is left when
                the link costs (almost) nothing;
  step          the step time across the link at each rate (the fastest of the steps after the first
                two: other jobs on the host only add time; medians are in the JSON);
  comm          the same bytes a step sends (pipezero's own count, metrics.jsonl `bytes_sent`) sent
                alone across the same link, with nothing else running (bench/link_probe.py:
                all-reduces of one bucket for D, both ranks sending activations for P);
  hidden        1 - (step - compute-only) / comm; for D layouts also 1 - waited / comm, from the
                time rank 0's traced steps blocked on ZeRO's collectives (less disturbed by other
                jobs on the CPUs than a difference of two step times).
gloo's reduce-scatter sends what an all-reduce of the whole bucket sends (measured: 1 MiB at
500mbit, 17.4 ms against 16.9 ms for the all-reduce and 8.6 ms for an all-gather), twice what
pipezero counts for it, so ZeRO-2/3's comm here understates their time on the wire.
Beside each measurement, the planner's prediction (planner/search.py `estimate`) with its compute
calibrated on the compute-only time (one factor a layout), its link set to the rate and the host's
CPU-seconds a GB across the link (`net_cpu_s_per_gb`) probed once a rate before the layouts run.
`--model dim=256,n_layers=4,vocab_size=256` overrides the preset's shape (with the bytes tokenizer a
vocabulary of 256 suffices, and the blocks then hold most gradient bytes, not the embedding);
`--launches` runs the ranks through bench/launch_times.py and prints, for D layouts, when each
bucket's collective was launched and completed against the end of the step's backward.
Writes bench/results/cluster_overlap/cluster_overlap.json and .png. The host's CPUs are shared: repeat before
trusting a difference under ~10%.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).resolve().parent / "results" / "cluster_overlap"
LAYOUTS = {
    "dp": [{"name": f"D=2 ZeRO-{z}", "pp": 1, "dp": 2, "zero": z, "schedule": "1f1b", "v": 1} for z in range(4)]
    # the updated weights' all-gather waited for at the end of the step, as before zero/weight_waits.py
    + [{"name": f"D=2 ZeRO-{z} gather at step end", "pp": 1, "dp": 2, "zero": z, "schedule": "1f1b", "v": 1,
        "flags": ["--no-overlap-gather"]} for z in (1, 2)]
    # ZeRO-3 layer by layer with each layer's gather started 2, 3 or 5 layers ahead (--zero3-prefetch;
    # the row above is depth 1, main's default)
    + [{"name": f"D=2 ZeRO-3 prefetch {d}", "pp": 1, "dp": 2, "zero": 3, "schedule": "1f1b", "v": 1,
        "flags": ["--zero3-prefetch", str(d)]} for d in (2, 3, 5)]
    # and with a block's attention and MLP as units of their own (--zero3-unit sublayer)
    + [{"name": f"D=2 ZeRO-3 sublayer prefetch {d}", "pp": 1, "dp": 2, "zero": 3, "schedule": "1f1b", "v": 1,
        "flags": ["--zero3-prefetch", str(d), "--zero3-unit", "sublayer"]} for d in (1, 2, 3, 5)]
    # the same with int8 gathers and reductions: a quarter of the bytes (what 200 Mbit needs to hide them)
    + [{"name": f"D=2 ZeRO-3 sublayer prefetch {d} int8", "pp": 1, "dp": 2, "zero": 3, "schedule": "1f1b", "v": 1,
        "flags": ["--zero3-prefetch", str(d), "--zero3-unit", "sublayer", "--quantize-weights", "int8",
                  "--quantize-grads", "int8"]} for d in (2, 3)],
    # an experiment through bench/launch_times.py (only with --layouts dp-exchange): ZeRO-2/3's
    # gradient reduce-scatter as a direct exchange, half of gloo's bytes at D=2
    "dp-exchange": [{"name": f"D=2 ZeRO-{z} exchange RS", "pp": 1, "dp": 2, "zero": z, "schedule": "1f1b", "v": 1,
                     "probe": ["--exchange-rs"]} for z in (2, 3)],
    # ZeRO-2/3 letting more reduce-scatters run while the backward goes on (default: one)
    "dp-inflight": [{"name": f"D=2 ZeRO-{z} {n} in flight", "pp": 1, "dp": 2, "zero": z, "schedule": "1f1b", "v": 1,
                     "flags": ["--buckets-in-flight", str(n)]} for z in (2, 3) for n in (4, 16)],
    "pp": [{"name": f"P=2 {s}", "pp": 2, "dp": 1, "zero": 0, "schedule": s, "v": v}
           for s, v in (("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2))],
}
def run_toml(preset: str, seq_len: int, bucket_mb: float, trace: bool = False, model: dict[str, int] | None = None,
             **parallel: int) -> str:
    """The benches' run settings: bytes tokens from a few MB of the built-in corpus, one thread a
    rank, no evaluation or sample; `model` overrides the preset's shape (dim=256, vocab_size=256, ...),
    `parallel` adds [parallel] settings (micro_batch_size=4, ...)."""
    extra = "".join(f"{k} = {v}\n" for k, v in parallel.items())
    shape = "".join(f"{k} = {v}\n" for k, v in (model or {}).items())
    return (f'[model]\npreset = "{preset}"\n{shape}'
            f'[data]\ntokenizer = "bytes"\nmax_bytes = 3000000\nseq_len = {seq_len}\n'
            f"[parallel]\n{extra}bucket_mb = {bucket_mb}\n[run]\neval_every = 0\neval_batches = 1\nsample_tokens = 0\n"
            f"progress = false\nthreads = 1\ntrace = {str(trace).lower()}\n")


def rate_bytes_per_s(rate: str) -> float:
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
    for u, f in units.items():
        if rate.endswith(u):
            return float(rate[: -len(u)]) * f / 8
    raise ValueError(f"rate {rate!r}: use kbit, mbit or gbit")


def on_cluster(nodes: int, per_node: int, link: str, argv: list[str], timeout: float = 900,
               stats: dict | None = None, pin: bool = False) -> str:
    """Run `argv` (after `python`) under torchrun on a fresh emulated cluster; node 0's output, or
    raise on failure. `stats`, if given, receives each node's link and TCP counters (`link_stats`)."""
    from pipezero.cluster import ClusterSpec, EmulatedCluster

    with EmulatedCluster(ClusterSpec(nodes=nodes, link=link, pin=pin)) as cluster:
        agents = [cluster.torchrun(i, per_node, 29500, argv, stdout=-1, stderr=-1) for i in range(nodes)]
        outs = [a.communicate(timeout=timeout) for a in agents]
        if stats is not None:
            stats.update(link_stats(cluster))
    for a, (_, err) in zip(agents, outs):
        if a.returncode:
            raise RuntimeError(err.decode()[-2000:])
    return outs[0][0].decode()


def link_stats(cluster: Any) -> dict[str, dict[str, int]]:
    """Per node, over the cluster's life: packets tbf dropped on the uplink (`eth0`) and downlink
    (the bridge end), and the node's TCP segments sent, retransmitted and retransmission timeouts
    (a namespace has counters of its own, from zero). Drops make TCP back off; a timeout stalls a
    connection for at least 200 ms (Linux's minimum RTO), which no bucket size can hide."""
    import re
    import subprocess

    def dropped(*cmd: str) -> int:
        said = subprocess.run([*cmd], capture_output=True, text=True).stdout
        return sum(int(x) for x in re.findall(r"dropped (\d+)", said))

    out = {}
    for i in range(cluster.spec.nodes):
        inside = ["ip", "netns", "exec", cluster.namespace(i)]
        tcp = subprocess.run([*inside, "nstat", "-asz", "TcpOutSegs", "TcpRetransSegs", "TcpExtTCPTimeouts"],
                             capture_output=True, text=True).stdout
        counts = {m[0]: int(m[1]) for m in re.findall(r"^(\w+)\s+(\d+)", tcp, re.M)}
        out[f"node{i}"] = {"up_dropped": dropped(*inside, "tc", "-s", "qdisc", "show", "dev", "eth0"),
                           "down_dropped": dropped("tc", "-s", "qdisc", "show", "dev", cluster.host_end(i)),
                           "tcp_out_segs": counts.get("TcpOutSegs", 0),
                           "tcp_retrans_segs": counts.get("TcpRetransSegs", 0),
                           "tcp_timeouts": counts.get("TcpExtTCPTimeouts", 0)}
    return out


def train(lay: dict, toml: Path, out: Path, steps: int, nodes: int, per_node: int, link: str,
          launches: bool = False, pin: bool = False) -> dict:
    """One run's steady step time, bytes a step and traced waits; `launches`: through
    bench/launch_times.py, with each bucket's launch and completion against the backward's end."""
    probe = lay.get("probe", [])
    entry = ([str(Path(__file__).resolve().parent / "launch_times.py"), *probe] if launches or probe
             else ["-m", "pipezero.cli"])
    stats: dict = {}
    on_cluster(nodes, per_node, link, [*entry, "train", "--config", str(toml), "--pp", str(lay["pp"]),
                                       "--dp", str(lay["dp"]), "--zero", str(lay["zero"]), "--schedule", lay["schedule"],
                                       "--virtual-stages", str(lay["v"]), "--max-steps", str(steps), "--out", str(out), "--no-save-final",
                                       *lay.get("flags", [])], stats=stats, pin=pin)
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    sent = [b["bytes_sent"] - a["bytes_sent"] for a, b in zip(recs, recs[1:])]
    steady = [r["step_time_s"] for r in recs[2:]]
    # Other jobs share this host's CPUs and only ever add time: the fastest steady step is the
    # figure least disturbed by them (the median is kept beside it).
    return {"step_s": min(steady), "step_s_median": statistics.median(steady),
            "step_s_all": [r["step_time_s"] for r in recs], "bytes_per_step": statistics.median(sent),
            "collective_wait_s": collective_waits(out / "trace.json"),
            "launches": launch_timeline(out / "trace.json") if launches else None, "link_stats": stats,
            "losses": [r["loss"] for r in recs]}


def collective_waits(trace: Path) -> float | None:
    """Rank 0's mean time a traced step blocked on ZeRO's gradient and parameter collectives (the
    exposed part of them; the norm's all-reduce, a sync point, is left out), or None untraced."""
    if not trace.exists():
        return None
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    waits: dict[int, float] = {}
    for e in events:
        step, name = e.get("args", {}).get("step"), e.get("name", "")
        if e.get("ph") != "X" or e.get("pid") != 0 or e.get("cat") != "wait" or step is None:
            continue
        if "of gradients" in name or "of parameters" in name:
            waits[step] = waits.get(step, 0.0) + e["dur"] / 1e6
    return statistics.fmean(waits.values()) if waits else 0.0


def launch_timeline(trace: Path) -> list[dict]:
    """Rank 0's traced steps, times in seconds from the end of its step's last backward: when each
    gradient bucket's collective was launched on rank 0 and on the latest rank (a collective can
    only run once every rank has launched it; ranks share a host's clocks), when it completed on
    rank 0 (bench/launch_times.py), and rank 0's blocked time on ZeRO's collectives. A bucket done
    after 0 was not hidden behind that backward."""
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    steps: dict[int, dict[int, list[dict]]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("args", {}).get("step") is not None:
            steps.setdefault(e["args"]["step"], {}).setdefault(e["pid"], []).append(e)
    out = []
    for step, ranks in sorted(steps.items()):
        evs = ranks.get(0, [])
        compute = [e for e in evs if e.get("cat") in ("F", "B", "W", "BW")]
        backward = [e for e in compute if e["cat"] != "F"]
        if not backward:
            continue
        start = min(e["ts"] for e in compute)
        end = max(e["ts"] + e["dur"] for e in backward)
        at = lambda t: round((t - end) / 1e6, 4)  # noqa: E731
        launches = {pid: [e["ts"] for e in es if e.get("cat") == "launch"] for pid, es in ranks.items()}
        latest = [at(max(ts)) for ts in zip(*launches.values())]  # bucket by bucket, the last rank's
        other_ends = {pid: at(max(e["ts"] + e["dur"] for e in es if e.get("cat") in ("B", "W", "BW")))
                      for pid, es in ranks.items() if pid and any(e.get("cat") in ("B", "W", "BW") for e in es)}
        waits = [(e["name"], at(e["ts"]), round(e["dur"] / 1e6, 4)) for e in evs if e.get("cat") == "wait"]
        out.append({"step": step, "backward_s": round((end - start) / 1e6, 4),
                    "launched": [at(t) for t in launches.get(0, [])], "launched_latest_rank": latest,
                    "other_ranks_backward_end": other_ends,
                    "done": [at(e["ts"]) for e in evs if e.get("cat") == "done"], "waits": waits})
    return out


def link_probe(link: str, nodes: int, per_node: int, kind: str, total: float, piece: int) -> dict:
    """bench/link_probe.py on a fresh emulated cluster: `seconds` for `total` bytes a rank in
    `piece`-sized transfers with nothing else running, and the host's `cpu_s` meanwhile."""
    probe = Path(__file__).resolve().parent / "link_probe.py"
    said = on_cluster(nodes, per_node, link, [str(probe), kind, str(int(total)), str(piece)])
    return json.loads(said.strip().splitlines()[-1])


def comm_alone(kind: str, total: float, piece: int, link: str, nodes: int = 2) -> float:
    """Seconds `total` bytes a rank take across `link` (nodes=1: inside one node) with nothing else
    running, between two ranks."""
    return link_probe(link, nodes, 2 // nodes, kind, total, piece)["seconds"]


def net_cpu_s_per_gb(link: str, piece: int) -> float:
    """Host CPU-seconds per GB crossing the emulated `link` (both ranks' all-reduces of one bucket,
    16 of them, alone; bench/link_probe.py's `cpu_s`): the planner's `net_cpu_s_per_gb`."""
    total = 16 * piece
    return link_probe(link, 2, 1, "dp", total, piece)["cpu_s"] / (2 * total / 1e9)  # each rank's bytes cross


def predicted(lay: dict, args: argparse.Namespace, compute_s: float, link: str, net_cpu: float) -> float:
    """The planner's step time for `lay` across `link`, its compute scaled to the measured compute-only
    (loopback inside one node, where no byte crosses a link and costs `net_cpu` a GB)."""
    from pipezero.config import ModelConfig, ScheduleKind
    from pipezero.models import apply_preset
    from pipezero.planner.layouts import Cluster, Layout
    from pipezero.planner.search import estimate

    model = apply_preset(ModelConfig(), args.preset)
    for k, v in args.model_fields.items():
        setattr(model, k, v)
    flags = lay.get("flags", [])
    depth = int(flags[flags.index("--zero3-prefetch") + 1]) if "--zero3-prefetch" in flags else 1
    bits = {f: int(flags[flags.index(f) + 1][3:]) if f in flags else 0 for f in ("--quantize-weights", "--quantize-grads")}
    layout = Layout(lay["pp"], lay["dp"], lay["zero"], ScheduleKind(lay["schedule"]), lay["v"], lay["mbs"],
                    lay["microbatches"], False, prefetch=depth, weight_bits=bits["--quantize-weights"],
                    grad_bits=bits["--quantize-grads"], sublayer="sublayer" in flags)
    batch = lay["mbs"] * lay["microbatches"] * lay["dp"]

    def at(gbps: float, mfu: float, cpu_s_per_gb: float) -> float:
        c = Cluster(2, 1e6, node_size=1, intra_gbps=1e6, inter_gbps=gbps, tflops=1.0, mfu=mfu, wire_bytes=4,
                    cpu=True, cores=len(os.sched_getaffinity(0)), net_cpu_s_per_gb=cpu_s_per_gb,
                    bucket_mb=args.bucket_mb)  # gloo's collectives, on this host's cores
        return estimate(model, args.seq_len, batch, c, layout).step_time_s

    mfu = at(1e9, 1.0, 0.0) / compute_s  # the compute time scales as 1 / mfu: match the measured one
    return at(rate_bytes_per_s(link) / 1e9, mfu, net_cpu)


def measure(args: argparse.Namespace, tmp: Path) -> list[dict]:
    from pipezero.models.presets import PRESETS

    dim = args.model_fields.get("dim", PRESETS[args.preset]["dim"])
    activation = args.mbs * args.seq_len * dim * 4  # fp32 bytes a micro-batch
    net_cpu = {link: net_cpu_s_per_gb(link, int(args.bucket_mb * 2**20)) for link in args.rates.split(",")}
    print("host CPU-s a GB across the link: " + ", ".join(f"{k} {v:.1f}" for k, v in net_cpu.items()), flush=True)
    rows = []
    for group in args.layouts.split(","):
        toml = tmp / f"{group}.toml"
        m = args.dp_microbatches if group.startswith("dp") else args.microbatches
        toml.write_text(run_toml(args.preset, args.seq_len, args.bucket_mb, trace=group.startswith("dp"),
                                 model=args.model_fields,
                                 micro_batch_size=args.mbs * args.microbatches // m, microbatches=m))
        skip = [x for x in args.skip.split(",") if x]
        for lay in [x for x in LAYOUTS[group] if any(o in x["name"] for o in args.only.split(","))
                    and not any(o in x["name"] for o in skip)]:
            lay = {**lay, "mbs": args.mbs * args.microbatches // m, "microbatches": m}
            runs = tmp / lay["name"].replace(" ", "_").replace("=", "")
            base = train(lay, toml, runs / "base", args.steps, 1, 2, args.rates.split(",")[0])
            if args.repeat_base:  # a second compute-only run: the faster of the two
                again = train(lay, toml, runs / "base2", args.steps, 1, 2, args.rates.split(",")[0])
                base = min(base, again, key=lambda r: r["step_s"])
            print(f"{lay['name']}: compute-only {base['step_s']:.3f} s, {base['bytes_per_step'] / 2**20:.2f} MiB "
                  f"a step a rank", flush=True)
            for link in args.rates.split(","):
                run = train(lay, toml, runs / link, args.steps, 2, 1, link,
                            launches=args.launches and group.startswith("dp"), pin=args.pin)
                piece = int(args.bucket_mb * 2**20) if group.startswith("dp") else activation
                comm = comm_alone("dp" if group.startswith("dp") else group, run["bytes_per_step"], piece, link)
                hidden = 1 - (run["step_s"] - base["step_s"]) / comm
                waited = run["collective_wait_s"]  # traced (D layouts): the exposed part, less CPU noise
                pred = predicted(lay, args, base["step_s"], link, net_cpu[link])
                rows.append({"layout": lay["name"], **lay, "link": link, "link_bytes_per_s": rate_bytes_per_s(link),
                             "compute_only_s": base["step_s"], "step_s": run["step_s"], "comm_s": comm,
                             "hidden": hidden, "bytes_per_step": run["bytes_per_step"], "predicted_s": pred,
                             "net_cpu_s_per_gb": net_cpu[link],
                             "collective_wait_s": waited, "hidden_by_waits": None if waited is None else 1 - waited / comm,
                             "step_s_median": run["step_s_median"], "compute_only_s_median": base["step_s_median"],
                             "step_s_all": run["step_s_all"], "compute_only_s_all": base["step_s_all"],
                             "launches": run["launches"], "link_stats": run["link_stats"], "losses": run["losses"],
                             "compute_only_losses": base["losses"]})
                partial = RESULTS / f"{args.name}.partial.json"  # what a crash later would lose
                partial.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
                by_waits = "" if waited is None else f" (by traced waits {1 - waited / comm:.0%})"
                print(f"  {link:>8}: step {run['step_s']:.3f} s, comm alone {comm:.3f} s, hidden {hidden:.0%}{by_waits}, "
                      f"planner {pred:.3f} s ({pred / run['step_s'] - 1:+.0%})", flush=True)
                print(f"    link and TCP counters: {run['link_stats']}", flush=True)
                for t in run["launches"] or []:
                    print(f"    step {t['step']}: backward {t['backward_s']:.3f} s, other ranks' end "
                          f"{t['other_ranks_backward_end']}; launched (s from its end) {t['launched']}, on the latest "
                          f"rank {t['launched_latest_rank']}; done {t['done']}; "
                          f"waited {sum(w[2] for w in t['waits']):.3f} s", flush=True)
    return rows


def draw(rows: list[dict], path: Path) -> None:
    """Step time against link rate, data-parallel layouts left, pipeline right; the planner dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("D=2 across the link", [r for r in rows if r["pp"] == 1]),
              ("P=2 across the link", [r for r in rows if r["pp"] > 1])]
    panels = [(t, rs) for t, rs in panels if rs]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (title, mine_all) in zip(axes[0], panels):
        for i, name in enumerate(dict.fromkeys(r["layout"] for r in mine_all)):
            mine = sorted((r for r in mine_all if r["layout"] == name), key=lambda r: r["link_bytes_per_s"])
            x = [r["link_bytes_per_s"] * 8 / 1e6 for r in mine]
            ax.plot(x, [r["step_s"] for r in mine], "o-", color=f"C{i}", label=f"{name} measured")
            ax.plot(x, [r["predicted_s"] for r in mine], "x--", color=f"C{i}", label=f"{name} planner")
            ax.axhline(mine[0]["compute_only_s"], color=f"C{i}", lw=0.6, ls=":")
        ax.set_xscale("log")
        ax.set_xlabel("link rate, Mbit/s (each node's uplink and downlink)")
        ax.set_ylabel("step time, s")
        ax.set_title(f"{title}: measured (o), planner (x), compute-only (dotted)", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="50mbit,200mbit,1gbit")
    ap.add_argument("--layouts", default="dp,pp")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=4, help="M of the pipeline layouts")
    ap.add_argument("--dp-microbatches", type=int, default=1,
                    help="M of the data-parallel layouts (same global batch): reductions of a step overlap only "
                         "the last micro-batch's backward")
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeat-base", action="store_true", help="run compute-only twice, keep the faster")
    ap.add_argument("--only", default="", help="only layouts whose name holds one of these, e.g. ZeRO-0,ZeRO-1")
    ap.add_argument("--skip", default="", help="leave out layouts whose name holds one of these, e.g. 'step end'")
    ap.add_argument("--model", default="", help="the preset's shape overridden, e.g. dim=256,n_layers=4,vocab_size=256 "
                    "(vocab 256 fits the bytes tokenizer and keeps the embedding a small share of the gradients)")
    ap.add_argument("--launches", action="store_true", help="D layouts: trace each bucket's launch and completion "
                    "(bench/launch_times.py) and print them against the backward's end")
    ap.add_argument("--pin", action="store_true", help="each node's ranks on a core of their own across the link "
                                                      "(pipezero cluster --pin)")
    ap.add_argument("--name", default="cluster_overlap")
    args = ap.parse_args()
    args.model_fields = {k: int(v) for k, v in (x.split("=") for x in args.model.split(",") if x)}
    with tempfile.TemporaryDirectory() as tmp:
        rows = measure(args, Path(tmp))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    (RESULTS / f"{args.name}.partial.json").unlink(missing_ok=True)
    draw(rows, RESULTS / f"{args.name}.png")
    print(f"wrote {RESULTS / args.name}.json and .png")


if __name__ == "__main__":
    main()
