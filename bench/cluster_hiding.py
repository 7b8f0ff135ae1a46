"""How much of ZeRO's traffic the step time hides, measured from outside the ranks.

    python bench/cluster_hiding.py [--zero 1,2,3] [--share 0.6] [--steps 12] [--repeat 2] [--pin]
                                   [--bursts 128kb,64kb] [--zero3-prefetch 1,2] [--zero3-unit layer,sublayer]
                                   [--microbatches 1,4] [--bucket-mb 1,0.25]

(as root). Each ZeRO stage runs D=2 on 2 emulated nodes x 1 rank, so every byte of its collectives
crosses a node's link. Nothing here asks pipezero what it sent or waited for:
  bytes      each node's link counters (the host end's rx/tx bytes in /sys/class/net, Ethernet
             frames as the wire carries them), sampled while the run goes and cut at the moments
             rank 0 appends a step to metrics.jsonl; the mean over steady steps of the larger of a
             node's sent and received bytes;
  unshaped   the steady step time with the links at --fast (no rate a 2-rank job comes near);
  rate       the link rate at which one step's bytes take --share x the unshaped step;
  shaped     the steady step time at that rate;
  hidden     1 - (shaped - unshaped) / transfer, transfer = bytes / rate (= share x unshaped):
             1 when the step does not grow at all, 0 when it grows by the whole transfer.
Beside it `hidden by waits`, from rank 0's trace (1 - blocked on ZeRO's collectives / transfer),
which is what the trace claims, and the same net of the unshaped run's waits (what the link added to
them: the unshaped run already waits for the peer rank when the two ranks' compute drifts apart on
shared cores). Each row also says where rank 0 waited, by collective (`UNSHARD(0.4)`, ...), in ms a
step. `--zero3-prefetch 1,2` measures ZeRO-3 at each prefetch depth, `--zero3-unit layer,sublayer`
with each unit (a block whole, or its attention and MLP apart), `--bucket-mb 1,0.25` ZeRO-1/2 with
each gradient bucket size (the step's last reduction and first gather move the model's first
bucket, which nothing hides: a smaller one exposes less); `--microbatches 1,4` cuts the
same --batch into that many micro-batches (a step's first gather and last reduction, which nothing
in the step can hide, are then paid once for M micro-batches' compute). Steady steps are those after the first two; step times are medians
(the minimum is in the JSON). Unpinned by default: the ranks share the host's cores with the
kernel's network path as they would share a node's. Repeats run the stages in turn, each time
measuring the unshaped step afresh. `--bursts 128kb,64kb` measures each stage with each tbf bucket
in turn (the cluster's default, 128kb, lets a 64 KB offloaded TCP packet cross whole; at 64kb tbf
cuts every one into MTU-sized packets in the host's softirq, CPU the ranks' compute then lacks).
Writes bench/results/cluster_hiding/cluster_hiding.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster_overlap import collective_waits, run_toml  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "cluster_hiding"
MODEL = {"dim": 256, "n_layers": 4, "vocab_size": 256}  # the blocks hold most of the gradient bytes


class LinkCounter:
    """Samples every node's link counters each time rank 0 appends a step to `metrics`: the bytes
    each node sent and received during each step, taken from the host end of its veth pair (what
    the host end received, the node sent)."""

    def __init__(self, cluster: object, metrics: Path) -> None:
        self.cluster, self.metrics = cluster, metrics
        self.marks: list[list[tuple[int, int]]] = []  # at each step's end: (sent, received) a node
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _read(self) -> list[tuple[int, int]]:
        out = []
        for i in range(self.cluster.spec.nodes):  # type: ignore[attr-defined]
            stats = Path("/sys/class/net") / self.cluster.host_end(i) / "statistics"  # type: ignore[attr-defined]
            out.append((int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())))
        return out

    def _run(self) -> None:
        lines = 0
        while not self._stop.is_set():
            now = self._read()
            seen = self.metrics.read_text().count("\n") if self.metrics.exists() else 0
            if seen > lines:  # a step ended since the last look (5 ms ago at most)
                self.marks += [now] * (seen - lines)
                lines = seen
            time.sleep(0.005)

    def __enter__(self) -> LinkCounter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def per_step(self) -> list[int]:
        """Each step after the first: the most any node sent or received in it."""
        return [max(max(b[0] - a[0], b[1] - a[1]) for a, b in zip(x, y)) for x, y in zip(self.marks, self.marks[1:])]


def waits_by_op(trace: Path) -> dict[str, float]:
    """Rank 0's traced waits on ZeRO's collectives, by collective (`UNSHARD(0.4)`), seconds a traced step."""
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    steps, by = set(), {}  # type: ignore[var-annotated]
    for e in events:
        step, name = e.get("args", {}).get("step"), e.get("name", "")
        if e.get("ph") != "X" or e.get("pid") != 0 or step is None:
            continue
        steps.add(step)
        if e.get("cat") == "wait" and ("of gradients" in name or "of parameters" in name):
            op = name.split(":", 1)[0]
            by[op] = by.get(op, 0.0) + e["dur"] / 1e6
    return {op: t / max(1, len(steps)) for op, t in sorted(by.items(), key=lambda kv: -kv[1])}


def run(zero: int, link: str, toml: Path, out: Path, steps: int, pin: bool, burst: str,
        flags: tuple[str, ...] = ()) -> dict:
    """One run of D=2 at `zero` on 2 nodes x 1 rank: steady step times, link bytes a step, traced waits."""
    from pipezero.cluster import ClusterSpec, EmulatedCluster

    argv = ["-m", "pipezero.cli", "train", "--config", str(toml), "--pp", "1", "--dp", "2", "--zero", str(zero),
            "--max-steps", str(steps), "--out", str(out), "--no-save-final", *flags]
    with EmulatedCluster(ClusterSpec(nodes=2, link=link, pin=pin, burst=burst)) as cluster:
        with LinkCounter(cluster, out / "metrics.jsonl") as counter:
            agents = [cluster.torchrun(i, 1, 29500, argv, stdout=-1, stderr=-1) for i in range(2)]
            said = [a.communicate(timeout=900) for a in agents]
    for a, (_, err) in zip(agents, said):
        if a.returncode:
            raise RuntimeError(err.decode()[-2000:])
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steady = [r["step_time_s"] for r in recs[2:]]
    link_bytes = counter.per_step()[1:]  # the second step on: steady
    own = [b["bytes_sent"] - a["bytes_sent"] for a, b in zip(recs, recs[1:])]
    return {"step_s": statistics.median(steady), "step_s_min": min(steady), "step_s_all": [r["step_time_s"] for r in recs],
            "link_bytes": statistics.median(link_bytes), "link_bytes_all": link_bytes,
            "own_bytes": statistics.median(own), "waits_s": collective_waits(out / "trace.json"),
            "waits_by_op": waits_by_op(out / "trace.json"), "losses": [r["loss"] for r in recs]}


def measure(zero: int, args: argparse.Namespace, tmp: Path, toml: Path, k: int, burst: str,
            prefetch: int = 1, microbatches: int = 1, unit: str = "layer", bucket_mb: float = 1.0) -> dict:
    flags = ("--micro-batch-size", str(args.batch // microbatches), "--microbatches", str(microbatches),
             "--bucket-mb", str(bucket_mb)) + (("--zero3-prefetch", str(prefetch), "--zero3-unit", unit) if zero == 3 else ())
    tag = f"z{zero}-p{prefetch}-{unit}-b{bucket_mb}-m{microbatches}-{k}-{burst}"
    fast = run(zero, args.fast, toml, tmp / f"{tag}-fast", args.steps, args.pin, burst, flags)
    rate = fast["link_bytes"] * 8 / (args.share * fast["step_s"])  # bits a second
    rate_mbit = max(1, round(rate / 1e6))
    shaped = run(zero, f"{rate_mbit}mbit", toml, tmp / f"{tag}-shaped", args.steps, args.pin, burst, flags)
    transfer = shaped["link_bytes"] * 8 / (rate_mbit * 1e6)
    hidden = 1 - (shaped["step_s"] - fast["step_s"]) / transfer
    waits = shaped["waits_s"]
    row = {"zero": zero, "prefetch": prefetch if zero == 3 else None, "unit": unit if zero == 3 else None,
           "bucket_mb": bucket_mb, "microbatches": microbatches, "repeat": k,
           "burst": burst, "rate_mbit": rate_mbit, "transfer_s": transfer, "unshaped": fast, "shaped": shaped,
           "hidden": hidden, "hidden_by_waits": 1 - waits / transfer,
           "hidden_by_waits_net": 1 - (waits - fast["waits_s"]) / transfer}
    where = ", ".join(f"{op} {t * 1e3:.0f}" for op, t in list(shaped["waits_by_op"].items())[:4])
    print(f"ZeRO-{zero}{f' prefetch {prefetch} {unit}' if zero == 3 else f' buckets {bucket_mb:g} MB'} M={microbatches} (run {k + 1}, burst {burst}): "
          f"{shaped['link_bytes'] / 1e6:.1f} MB a node a step on the link "
          f"(pipezero counts {shaped['own_bytes'] / 1e6:.1f}), {rate_mbit} Mbit/s, "
          f"step {fast['step_s']:.3f} -> {shaped['step_s']:.3f} s, transfer {transfer:.3f} s: "
          f"hidden {hidden:.0%} by step time, {row['hidden_by_waits']:.0%} by traced waits "
          f"({row['hidden_by_waits_net']:.0%} net of the unshaped run's {fast['waits_s'] * 1e3:.0f} ms); "
          f"waited most on (ms a step): {where}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--zero", default="1,2,3")
    ap.add_argument("--share", type=float, default=0.6, help="one step's transfer at the chosen rate, as a share "
                    "of the unshaped step")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--fast", default="20gbit", help="the 'unshaped' link rate")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16, help="sequences a rank a step (one micro-batch)")
    ap.add_argument("--bucket-mb", default="1", help="gradient bucket sizes in MB to measure ZeRO-1/2 with, in turn "
                    "(ZeRO-3 layer by layer has a bucket a unit)")
    ap.add_argument("--bursts", default="128kb", help="tbf buckets to measure each stage with, in turn")
    ap.add_argument("--zero3-prefetch", default="1", help="ZeRO-3's prefetch depths to measure, in turn")
    ap.add_argument("--zero3-unit", default="layer", help="ZeRO-3's units to measure, in turn (layer,sublayer)")
    ap.add_argument("--microbatches", default="1", help="micro-batches a step to measure, in turn (each divides --batch)")
    ap.add_argument("--pin", action="store_true", help="each node on a core of its own (pipezero cluster --pin)")
    ap.add_argument("--name", default="cluster_hiding")
    args = ap.parse_args()
    import os

    load = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        toml = Path(tmp) / "run.toml"
        toml.write_text(run_toml("tiny", args.seq_len, 1.0, trace=True, model=MODEL,
                                 micro_batch_size=args.batch, microbatches=1))
        depths = [int(d) for d in args.zero3_prefetch.split(",")]
        units = args.zero3_unit.split(",")
        for k in range(args.repeat):
            for m in (int(x) for x in args.microbatches.split(",")):
                if args.batch % m:
                    raise SystemExit(f"--microbatches {m} does not divide --batch {args.batch}")
                for zero in (int(z) for z in args.zero.split(",")):
                    for depth, unit, mb in ([(d, u, 1.0) for d in depths for u in units] if zero == 3 else
                                            [(1, "layer", float(b)) for b in args.bucket_mb.split(",")]):
                        for burst in args.bursts.split(","):
                            rows.append(measure(zero, args, Path(tmp), toml, k, burst, depth, m, unit, mb))
    print("\n| ZeRO | M | run | tbf burst | MB a node a step (link / own count) | Mbit/s | unshaped s | shaped s | "
          "transfer s | hidden by step time | by traced waits (net of unshaped) |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        name = f"{r['zero']}" + (f", prefetch {r['prefetch']}, {r['unit']}" if r["zero"] == 3 else
                                 f", buckets {r['bucket_mb']:g} MB")
        print(f"| {name} | {r['microbatches']} | {r['repeat'] + 1} | {r['burst']} | {r['shaped']['link_bytes'] / 1e6:.1f} / "
              f"{r['shaped']['own_bytes'] / 1e6:.1f} | {r['rate_mbit']} | {r['unshaped']['step_s']:.3f} | "
              f"{r['shaped']['step_s']:.3f} | {r['transfer_s']:.3f} | {r['hidden']:.0%} | "
              f"{r['hidden_by_waits']:.0%} ({r['hidden_by_waits_net']:.0%}) |")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{args.name}.json"
    path.write_text(json.dumps({"args": vars(args), "load_before": load, "load_after": os.getloadavg(),
                                "date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
