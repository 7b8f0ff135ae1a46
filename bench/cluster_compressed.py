"""Compressed traffic (ZeRO++'s qwZ, qgZ and hpZ) on the emulated cluster: bytes across the node
links, step time and held-out loss, beside the uncompressed run and the planner's prediction.

    python bench/cluster_compressed.py [--rates 100mbit,200mbit] [--layouts p2-1f1b-z3,...] [--variants none,all4]
                                       [--rows p1-z3:hpz,...] [--steps 7] [--loss-steps 300 | 0] [--seeds 1234,1,2] [--no-cluster]
    python bench/cluster_compressed.py --table A.json,B.json --name cluster_compressed   # merge, predict again

(as root). 2 emulated nodes x 2 ranks, pinned (each node's ranks on a core of their own), the
block-dominated model (`--model dim=256,n_layers=4,vocab_size=256`, seq 128), 16 sequences a step.
Layouts:
  P=2 D=2 (1f1b, zb-v) x (ZeRO-2, ZeRO-3), `--placement pp-inner`: rank = replica x P + stage, so a
      node holds one pipeline (its activations stay inside it) and every data-parallel group
      {stage s of replica 0, stage s of replica 1} spans both nodes: every ZeRO byte crosses a link.
      (dp-inner would keep the D groups inside the nodes and send only activations across.)
  P=1 D=4 ZeRO-3 (dp-inner): one group of 4, two ranks a node: the layout hpZ and --hierarchical
      apply to (hpZ needs ZeRO-3 layer by layer and 2+ ranks of a group on each node; at P=2 train
      refuses it, and the refusal line is the table's entry).
Variants: none; w8 (--quantize-weights int8); g8, g4 (--quantize-grads int8 / int4); hpz
(--secondary-shard node); all8 / all4: every option that applies together (weights int8, grads
int8 / int4, and at P=1 hpZ with --hierarchical). For each (layout, variant):
  compute-only  the step time with the 4 ranks in one namespace (loopback, unshaped): the
                planner's compute is calibrated on it (cluster_overlap.predicted's method), on the
                variant's own run and, to show what quantizing costs the CPU, on the uncompressed one;
  bytes across  read by a thread from the host ends' /sys/class/net/<if>/statistics/{rx,tx}_bytes
                every 20 ms, a step's share taken between the moments rank 0 appended step k's line
                to metrics.jsonl (the same thread watches the file): the counters at the end of
                step 2 and of step n-1 (the last step also evaluates, and ZeRO-3's evaluation
                gathers weights), over n-3 steps. The host end's rx is what its node sent (uplink),
                tx what it received; a byte crossing goes up one link and down another, so the
                figure is the sum of the uplinks (the wire's bytes: TCP/IP headers and ACKs too).
                pipezero's own count (rank 0's metrics.jsonl bytes_sent a step, and every rank's
                summary.json collectives and p2p over the run) is printed beside it;
  step          the fastest and the median of the steps after the first two, at each rate;
  planner       planner/search.py `estimate` with that compute, the link measured (gloo's ring across
                the 2 nodes, bench/cluster_placement.link_rate, shared by a node's 2 ranks), the
                in-node copy rate measured and the host's CPU-seconds a GB across the link;
  held-out loss `--loss-steps` steps of the same variant on ONE node (`--nproc 4`, loopback, no
                shaping, `ranks_per_node = 2` so that --hierarchical and hpZ cut the ranks into the
                same two "nodes" as on the cluster): the computation does not depend on the link,
                and the first steps' losses of each cluster run are compared with it. With `--seeds`,
                one run a seed (weights and data order), and each variant's ratio to `none` taken
                seed by seed: one run's ratio strays by about as much as the goal (1%) allows.
Writes bench/results/cluster_compressed/<name>.json (with `uptime`) and prints a markdown table. The host's cores are
shared with other jobs: steps are the fastest steady ones, medians beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster_overlap import RESULTS, comm_alone, net_cpu_s_per_gb, run_toml  # noqa: E402

MODEL = {"dim": 256, "n_layers": 4, "vocab_size": 256}
NODES, PER_NODE = 2, 2
LAYOUTS = {  # 16 sequences a step each (B x M x D)
    **{f"p2-{s}-z{z}": {"pp": 2, "dp": 2, "zero": z, "schedule": s, "v": 2 if s == "zb-v" else 1, "mbs": 2,
                        "microbatches": 4, "placement": "pp-inner"} for s in ("1f1b", "zb-v") for z in (3, 2)},
    "p1-z3": {"pp": 1, "dp": 4, "zero": 3, "schedule": "1f1b", "v": 1, "mbs": 2, "microbatches": 2,
              "placement": "dp-inner"},
}
W8, G8, G4, HPZ = (["--quantize-weights", "int8"], ["--quantize-grads", "int8"], ["--quantize-grads", "int4"],
                   ["--secondary-shard", "node"])
DEFAULT_SEED = 1234  # train's (config.py RunConfig.seed)
VARIANTS = {"none": [], "w8": W8, "g8": G8, "g4": G4, "hpz": HPZ, "all8": W8 + G8 + HPZ, "all4": W8 + G4 + HPZ}


def flags(lay: dict, variant: str) -> list[str]:
    """`train` flags of a layout and variant. `all*` keeps only what applies: hpZ and --hierarchical
    need 2+ ranks of a group on each node, which P=2 pp-inner (one rank of each group a node) lacks;
    `hpz` alone is passed as is, so that train's refusal is what the table shows."""
    extra = list(VARIANTS[variant])
    if variant.startswith("all"):
        if lay["pp"] > 1:
            extra = [x for x in extra if x not in HPZ]
        else:
            extra.append("--hierarchical")
    return ["--pp", str(lay["pp"]), "--dp", str(lay["dp"]), "--zero", str(lay["zero"]), "--schedule",
            lay["schedule"], "--virtual-stages", str(lay["v"]), "--micro-batch-size", str(lay["mbs"]),
            "--microbatches", str(lay["microbatches"]),
            # train reads --placement only with P > 1 and D > 1 (elsewhere it refuses it as unread)
            *(["--placement", lay["placement"]] if lay["pp"] > 1 and lay["dp"] > 1 else []), *extra]


def config_for(argv: list[str], plain: Path, by_node: Path) -> Path:
    """The TOML a run's `argv` takes: ranks a node only where --hierarchical or hpZ reads them."""
    return by_node if "--hierarchical" in argv or "--secondary-shard" in argv else plain


def groups_across(lay: dict) -> str:
    """The layout's data-parallel groups and the nodes each rank sits on (rank // ranks a node)."""
    from pipezero.config import Placement
    from pipezero.parallel.mesh import Mesh

    groups = Mesh(lay["pp"], lay["dp"], placement=Placement(lay["placement"])).dp_groups()
    return "; ".join("{" + ", ".join(f"r{r}@n{r // PER_NODE}" for r in g) + "}" for g in groups)


def toml_text(eval_batches: int = 1, by_node: bool = False) -> str:
    """The benches' run settings, the block-dominated model, and with `by_node` (the flags hold
    --hierarchical or hpZ, which alone read it) 2 ranks a node wherever the run is (on one node too:
    the same two-level cut, so the same computation)."""
    text = run_toml("tiny", 128, 1.0, model=MODEL, **({"ranks_per_node": PER_NODE} if by_node else {}))
    return text.replace("eval_batches = 1", f"eval_batches = {eval_batches}")


class LinkCounter(threading.Thread):
    """Samples each node's host-end byte counters every `period` s, with the number of lines in
    `metrics` (one a finished step), until stopped."""

    def __init__(self, ends: list[str], metrics: Path, period: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.ends, self.metrics, self.period = ends, metrics, period
        self.samples: list[tuple[float, int, list[int], list[int]]] = []  # (t, lines, up, down)
        self.done = threading.Event()

    @staticmethod
    def _read(end: str, what: str) -> int:
        return int(Path(f"/sys/class/net/{end}/statistics/{what}_bytes").read_text())

    def run(self) -> None:
        while not self.done.is_set():
            try:
                lines = self.metrics.read_bytes().count(b"\n") if self.metrics.exists() else 0
                up = [self._read(e, "rx") for e in self.ends]  # the host end receives what its node sends
                down = [self._read(e, "tx") for e in self.ends]
            except (OSError, ValueError):
                break  # the links are gone: the cluster is closing
            self.samples.append((time.monotonic(), lines, up, down))
            self.done.wait(self.period)

    def step_ends(self) -> dict[int, tuple[int, int]]:
        """(sum of uplinks, sum of downlinks) at the first sample that saw step k's line."""
        out: dict[int, tuple[int, int]] = {}
        for _, lines, up, down in self.samples:
            for k in range(1, lines + 1):
                out.setdefault(k, (sum(up), sum(down)))
        return out


def step_bytes(ends: dict[int, tuple[int, int]], steps: int) -> dict:
    """A steady step's bytes across: counters from the end of step 2 to the end of step n-1."""
    first, last = 2, steps - 1
    if first not in ends or last not in ends or last <= first:
        return {"up": None, "down": None, "per_step_up": []}
    n = last - first
    per = [ends[k][0] - ends[k - 1][0] for k in range(first + 1, last + 1) if k - 1 in ends]
    return {"up": (ends[last][0] - ends[first][0]) / n, "down": (ends[last][1] - ends[first][1]) / n,
            "per_step_up": per}


def cluster_run(argv: list[str], out: Path, nodes: int, per_node: int, link: str, pin: bool,
                timeout: float = 900) -> dict:
    """`train` on a fresh emulated cluster with the link counters sampled; its records."""
    from pipezero.cluster import ClusterSpec, EmulatedCluster

    with EmulatedCluster(ClusterSpec(nodes=nodes, link=link, pin=pin)) as cluster:
        counter = LinkCounter([cluster.host_end(i) for i in range(nodes)], out / "metrics.jsonl")
        counter.start()
        agents = [cluster.torchrun(i, per_node, 29500, ["-m", "pipezero.cli", "train", *argv, "--out", str(out),
                                                        "--no-save-final"], stdout=-1, stderr=-1)
                  for i in range(nodes)]
        outs = [a.communicate(timeout=timeout) for a in agents]
        counter.done.set()
        counter.join()
    for a, (_, err) in zip(agents, outs):
        if a.returncode:
            raise RuntimeError(err.decode()[-2000:])
    return {**records(out), "ends": counter.step_ends()}


def records(out: Path) -> dict:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    steady = [r["step_time_s"] for r in recs[2:]]
    sent = [b["bytes_sent"] - a["bytes_sent"] for a, b in zip(recs[1:-1], recs[2:-1])]
    return {"step_s": min(steady), "step_s_median": statistics.median(steady), "step_s_all": [r["step_time_s"] for r in recs],
            "losses": [r["loss"] for r in recs], "rank0_bytes_per_step": statistics.median(sent) if sent else None,
            "pz_bytes_run": summary["bytes_sent"], "heldout": summary.get("final_heldout_loss"),
            "held_bytes": [r.get("held_bytes") for r in summary.get("ranks", [])]}


def refusal(argv: list[str]) -> str | None:
    """train's one-line refusal of `argv` on 2 nodes x 2 ranks (the checks `pipezero cluster` runs
    before it builds anything), or None where it would run."""
    from pipezero.cli.cluster import cluster_job
    from pipezero.cli.command_line import build_parser
    from pipezero.errors import ConfigError

    try:
        cluster_job(["train", *argv], NODES * PER_NODE, build_parser(), f"{NODES} nodes x {PER_NODE}")
    except ConfigError as e:
        return str(e)
    return None


def loopback_run(argv: list[str], out: Path, timeout: float = 1800) -> dict:
    """`train --nproc 4` on this host's loopback (no namespaces, no shaping)."""
    done = subprocess.run([sys.executable, "-m", "pipezero.cli", "train", *argv, "--nproc", "4", "--out", str(out),
                           "--no-save-final"], capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    return records(out)


def planner_layout(lay: dict, argv: list[str]):
    """planner/layouts.Layout of a layout and its train flags."""
    from pipezero.config import Placement, ScheduleKind
    from pipezero.planner.layouts import Layout

    def val(flag: str) -> str | None:
        return argv[argv.index(flag) + 1] if flag in argv else None

    bits = {None: 0, "int8": 8, "int4": 4}
    return Layout(lay["pp"], lay["dp"], lay["zero"], ScheduleKind(lay["schedule"]), lay["v"], lay["mbs"],
                  lay["microbatches"], False, placement=Placement(lay["placement"]),
                  hierarchical="--hierarchical" in argv, weight_bits=bits[val("--quantize-weights")],
                  grad_bits=bits[val("--quantize-grads")], secondary=val("--secondary-shard") == "node")


def cluster_of(node_size: int, intra: float, inter: float, mfu: float, net_cpu: float):
    from pipezero.planner.layouts import Cluster

    return Cluster(NODES * PER_NODE, 1e6, node_size, intra, inter, tflops=1.0, mfu=mfu, wire_bytes=4, cpu=True,
                   cores=len(os.sched_getaffinity(0)), net_cpu_s_per_gb=net_cpu, bucket_mb=1.0)


def calibrated_mfu(layout, compute_s: float, intra: float) -> float:
    """The planner's mfu that reproduces `compute_s`, the layout's step with all 4 ranks on one node
    (its in-node copies at the measured rate `intra` included): the step is a + b / mfu piecewise,
    so a few secant steps settle it."""
    from pipezero.config import ModelConfig
    from pipezero.models import apply_preset
    from pipezero.planner.search import estimate

    model = apply_preset(ModelConfig(), "tiny")
    for k, v in MODEL.items():
        setattr(model, k, v)

    def at(u: float) -> float:
        return estimate(model, 128, 16, cluster_of(NODES * PER_NODE, intra, intra, 1.0 / u, 0.0), layout).step_time_s

    u0, u1 = 1.0, compute_s / at(1.0)
    f0, f1 = at(u0) - compute_s, at(u1) - compute_s
    for _ in range(20):
        if abs(f1) < 1e-6 * compute_s or f1 == f0:
            break
        u0, u1 = u1, max(1e-9, u1 - f1 * (u1 - u0) / (f1 - f0))
        f0, f1 = f1, at(u1) - compute_s
    return 1.0 / u1


def predict(layout, mfu: float, intra: float, inter: float, net_cpu: float) -> tuple[float, float]:
    """(step time, bytes crossing the node links a step) the planner gives on the 2 x 2 cluster."""
    from pipezero.config import ModelConfig
    from pipezero.models import apply_preset
    from pipezero.planner.search import estimate

    model = apply_preset(ModelConfig(), "tiny")
    for k, v in MODEL.items():
        setattr(model, k, v)
    e = estimate(model, 128, 16, cluster_of(PER_NODE, intra, inter, mfu, net_cpu), layout)
    return e.step_time_s, e.crossing_bytes


def link_rate(link: str) -> float:
    """Bytes a second a node's link carried in gloo's ring across the 2 nodes (one rank each), alone."""
    from cluster_placement import link_rate as ring

    return ring(link, NODES, 2**20)


def measure(args: argparse.Namespace, tmp: Path) -> dict:
    rates = [r for r in args.rates.split(",") if r]
    toml, toml_nodes = tmp / "run.toml", tmp / "run-nodes.toml"
    toml.write_text(toml_text())
    toml_nodes.write_text(toml_text(by_node=True))
    piece = 2**20
    probes = {}
    if not args.no_cluster:
        intra = 8 * piece / comm_alone("dp", 8 * piece, piece, rates[0], nodes=1) / 1e9
        for link in rates:
            # other jobs on the host only add CPU-seconds: the smaller of two probes
            probes[link] = {"link_bytes_per_s": link_rate(link),
                            "net_cpu_s_per_gb": min(net_cpu_s_per_gb(link, piece) for _ in range(2))}
        probes["intra_gbps"] = intra
        print(f"probes: in-node {intra:.2f} GB/s a rank; " + "; ".join(
            f"{k}: ring {v['link_bytes_per_s'] * 8 / 1e6:.1f} Mbit/s a node, {v['net_cpu_s_per_gb']:.1f} CPU-s a GB"
            for k, v in probes.items() if k != "intra_gbps"), flush=True)
    rows: list[dict] = []
    pairs = ([tuple(x.split(":")) for x in args.rows.split(",")] if args.rows else
             [(name, variant) for name in args.layouts.split(",") for variant in args.variants.split(",")])
    for name in dict.fromkeys(name for name, _ in pairs):
        lay = LAYOUTS[name]
        print(f"{name}: data-parallel groups {groups_across(lay)}", flush=True)
        base_compute = None
        for variant in [v for n, v in pairs if n == name]:
            argv = ["--config", str(config_for(flags(lay, variant), toml, toml_nodes)), *flags(lay, variant)]
            row: dict = {"layout": name, **lay, "variant": variant, "flags": flags(lay, variant)[len(flags(lay, "none")):],
                         "groups": groups_across(lay)}
            refused = refusal(argv)
            if refused:
                row["refused"] = refused
                rows.append(row)
                print(f"  {variant}: refused: {refused}", flush=True)
                continue
            layout = planner_layout(lay, argv)
            if not args.no_cluster:
                # other jobs on the host only add time: the fastest of --repeat-compute runs
                compute = min((cluster_run([*argv, "--max-steps", str(args.steps)], tmp / f"{name}-{variant}-c{k}", 1,
                                           NODES * PER_NODE, rates[0], args.pin) for k in range(args.repeat_compute)),
                              key=lambda c: c["step_s"])
                base_compute = base_compute if variant != "none" else compute["step_s"]
                row["compute_only_s"], row["compute_only_s_median"] = compute["step_s"], compute["step_s_median"]
                row["compute_only_loadavg"] = os.getloadavg()  # the host's 1, 5 and 15 min load after the run
                row["compute_only_losses"] = compute["losses"]
                mfu = calibrated_mfu(layout, compute["step_s"], probes["intra_gbps"])
                mfu_base = calibrated_mfu(layout, base_compute, probes["intra_gbps"]) if base_compute else None
                row["mfu"], row["mfu_uncompressed"] = mfu, mfu_base
                row["links"] = {}
                for link in rates:
                    got = cluster_run([*argv, "--max-steps", str(args.steps)], tmp / f"{name}-{variant}-{link}", NODES,
                                      PER_NODE, link, args.pin)
                    across = step_bytes(got.pop("ends"), args.steps)
                    p = probes[link]
                    inter = p["link_bytes_per_s"] / PER_NODE / 1e9
                    pred, pred_bytes = predict(layout, mfu, probes["intra_gbps"], inter, p["net_cpu_s_per_gb"])
                    pred_base = (predict(layout, mfu_base, probes["intra_gbps"], inter, p["net_cpu_s_per_gb"])[0]
                                 if mfu_base else None)
                    row["links"][link] = {**got, "bytes_across": across, "predicted_s": pred, "loadavg": os.getloadavg(),
                                          "predicted_s_uncompressed_calibration": pred_base,
                                          "predicted_bytes_across": pred_bytes}
                    print(f"  {variant} {link}: step {got['step_s']:.3f} s (median {got['step_s_median']:.3f}), "
                          f"compute-only {compute['step_s']:.3f} s; across {fmt_mb(across['up'])} MB a step "
                          f"(down {fmt_mb(across['down'])}; planner {pred_bytes / 1e6:.2f}); pipezero rank 0 "
                          f"{fmt_mb(got['rank0_bytes_per_step'])} MB a step; planner {pred:.3f} s "
                          f"({pred / got['step_s'] - 1:+.0%})"
                          + (f", on the uncompressed calibration {pred_base:.3f} s" if pred_base else ""), flush=True)
                    (RESULTS / f"{args.name}.partial.json").write_text(json.dumps({"rows": rows + [row]}, indent=2))
            if args.loss_steps:
                loss_toml = tmp / "loss.toml"
                loss_toml.write_text(toml_text(eval_batches=4, by_node=config_for(flags(lay, variant), toml,
                                                                                   toml_nodes) == toml_nodes))
                by_seed: dict[str, float] = {}
                for i, seed in enumerate(args.seeds):
                    got = loopback_run(["--config", str(loss_toml), *flags(lay, variant), "--max-steps",
                                        str(args.loss_steps), "--seed", str(seed)], tmp / f"{name}-{variant}-loss-{seed}")
                    by_seed[str(seed)] = got["heldout"]
                    if i == 0:  # the first seed's run: with the default seed, the cluster runs' computation
                        row["loss_losses_first"] = got["losses"][:5]
                        row["loss_step_s"] = got["step_s_median"]
                        row["final_train_loss"] = got["losses"][-1]
                row["heldout_loss"] = statistics.fmean(by_seed.values())
                row["heldout_by_seed"] = by_seed
                first = [r["losses"][:5] for r in row.get("links", {}).values()]
                row["cluster_first_losses_equal"] = [a == b for a, b in zip(first[0], row["loss_losses_first"])] \
                    if first else None
                print(f"  {variant}: held-out loss after {args.loss_steps} steps "
                      + ", ".join(f"{v:.4f} (seed {k})" for k, v in by_seed.items())
                      + (f"; cluster's first 5 losses equal: {row['cluster_first_losses_equal']}" if first else ""),
                      flush=True)
            rows.append(row)
    return {"probes": probes, "rows": rows}


def held_out(r: dict, base: dict | None) -> tuple[str, str]:
    """A row's held-out loss and its ratio to the uncompressed row's. With several seeds: the mean
    loss, and the mean of the per-seed ratios (each seed's run against the uncompressed run of the
    same seed: same weights at the start, same batches) with their lowest and highest, which show
    how far one run's ratio strays: a goal of 1% means little where one seed's ratio strays more."""
    loss = r.get("heldout_loss")
    if loss is None:
        return "", ""
    mine, theirs = r.get("heldout_by_seed", {}), (base or {}).get("heldout_by_seed", {})
    paired = [mine[k] / theirs[k] for k in mine if k in theirs]
    if len(paired) > 1:
        return (f"{loss:.4f} ({len(mine)} seeds)",
                f"{statistics.fmean(paired):.4f} [{min(paired):.4f}-{max(paired):.4f}]")
    # one run: at the default seed (older files, or --seeds left as it is), so against that seed's
    # uncompressed run where the base has several
    b_loss = theirs.get(next(iter(mine), str(DEFAULT_SEED)), (base or {}).get("heldout_loss"))
    return f"{loss:.4f}", "" if not b_loss else f"{loss / b_loss:.4f}"


def fmt_mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.2f}"


def table(rows: list[dict], rates: list[str]) -> str:
    """One markdown line a layout, variant and rate; ratios against the layout's uncompressed row."""
    lines = ["| layout | variant | link | MB across a step (wire) | x none | pipezero rank 0 MB | step s (median) "
             "| x faster | compute-only s | planner s (err) | held-out loss | x none |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {(r["layout"], link): r["links"][link] for r in rows if r["variant"] == "none" for link in r.get("links", {})}
    base_row = {r["layout"]: r for r in rows if r["variant"] == "none"}
    for r in rows:
        loss_s, loss_x = held_out(r, base_row.get(r["layout"]))
        if "refused" in r:
            lines.append(f"| {r['layout']} | {r['variant']} | | refused: {r['refused'][:140]} | | | | | | | | |")
            continue
        if not r.get("links"):
            lines.append(f"| {r['layout']} | {r['variant']} | | | | | | | | | {loss_s} | {loss_x} |")
        for link in rates:
            x = r.get("links", {}).get(link)
            if x is None:
                continue
            b = base.get((r["layout"], link))
            up = x["bytes_across"]["up"]
            ratio = "" if not b or up is None or not b["bytes_across"]["up"] else f"{up / b['bytes_across']['up']:.3f}"
            faster = "" if not b else f"{b['step_s'] / x['step_s']:.2f}"
            lines.append(f"| {r['layout']} | {r['variant']} | {link} | {fmt_mb(up)} | {ratio} | "
                         f"{fmt_mb(x['rank0_bytes_per_step'])} | {x['step_s']:.3f} ({x['step_s_median']:.3f}) | {faster} | "
                         f"{r['compute_only_s']:.3f} | {x['predicted_s']:.3f} ({x['predicted_s'] / x['step_s'] - 1:+.0%}) | "
                         f"{loss_s} | {loss_x} |")
    return "\n".join(lines)


def merged(paths: list[Path]) -> dict:
    """Rows of several result files as one: a (layout, variant) row's cluster figures from the file
    that has them, its held-out loss from the one that has that; the planner's predictions made
    again from each row's calibration with today's planner."""
    probes: dict = {}
    rows: dict[tuple[str, str], dict] = {}
    for path in paths:
        got = json.loads(path.read_text())
        probes.update(got.get("probes", {}))
        for r in got["rows"]:
            mine = rows.setdefault((r["layout"], r["variant"]), {})
            mine.update({k: v for k, v in r.items() if v is not None and (k != "links" or v)})
            if r.get("links"):  # the probes its calibration and predictions used, from its own file
                mine["probes"] = got["probes"]
    for r in rows.values():
        if "refused" in r or not r.get("links"):
            continue
        if r.get("loss_losses_first"):  # the loopback run's first losses against each cluster run's
            r["first_losses_max_rel_diff"] = {
                link: max(abs(a - b) / abs(b) for a, b in zip(x["losses"][:5], r["loss_losses_first"]))
                for link, x in r["links"].items()}
        layout, mine = planner_layout(LAYOUTS[r["layout"]], r["flags"]), r["probes"]
        for link, x in r["links"].items():
            inter = mine[link]["link_bytes_per_s"] / PER_NODE / 1e9
            x["predicted_s"], x["predicted_bytes_across"] = predict(layout, r["mfu"], mine["intra_gbps"], inter,
                                                                    mine[link]["net_cpu_s_per_gb"])
            if r.get("mfu_uncompressed"):
                x["predicted_s_uncompressed_calibration"] = predict(layout, r["mfu_uncompressed"], mine["intra_gbps"],
                                                                    inter, mine[link]["net_cpu_s_per_gb"])[0]
    order = {name: i for i, name in enumerate(LAYOUTS)}
    kinds = {name: i for i, name in enumerate(VARIANTS)}
    return {"probes": probes, "rows": sorted(rows.values(), key=lambda r: (order[r["layout"]], kinds[r["variant"]]))}


OPTION_SETS = {"none": (0, 0, False), "w8 g8": (8, 8, False), "w8 g8 hpZ": (8, 8, True), "w8 g4 hpZ": (8, 4, True)}


def plan_picks(mfu: float, probes: dict, link: str, top: int = 3) -> dict[str, list[dict]]:
    """What `plan` (planner/search.plan, the library call behind `pipezero plan`, which takes only a
    preset's shape) ranks first on this cluster, the block-dominated model and 16 sequences a step,
    compute calibrated as the bench's rows, without and with each set of options: the options are
    the run's flags there, applied to every layout where they have traffic to change."""
    from pipezero.config import ModelConfig
    from pipezero.models import apply_preset
    from pipezero.planner.search import plan

    model = apply_preset(ModelConfig(), "tiny")
    for k, v in MODEL.items():
        setattr(model, k, v)
    cluster = cluster_of(PER_NODE, probes["intra_gbps"], probes[link]["link_bytes_per_s"] / PER_NODE / 1e9, mfu,
                         probes[link]["net_cpu_s_per_gb"])
    out = {}
    for name, (w, g, hpz) in OPTION_SETS.items():
        fits, _ = plan(model, cluster, 128, 16, w, g, 256, hpz)
        out[name] = [{"layout": (f"P={e.layout.pp} D={e.layout.dp} ZeRO-{e.layout.zero} {e.layout.schedule.value} "
                                 f"V={e.layout.virtual} B={e.layout.micro_batch} M={e.layout.microbatches} "
                                 f"{e.layout.placement.value}" + (" two-level" if e.layout.hierarchical else "")
                                 + (" hpZ" if e.layout.secondary else "") + (" rc" if e.layout.recompute else "")),
                      "step_s": e.step_time_s, "crossing_mb": e.crossing_bytes / 1e6} for e in fits[:top]]
    return out


def compact_table(rows: list[dict], rates: list[str]) -> str:
    """One line a layout and variant, both rates side by side (the docs' table): MB across a step
    at the first rate and its ratio to `none`, each rate's fastest step, its speed-up over `none` and
    the planner's error, and the held-out loss with its ratio."""
    base = {(r["layout"], link): r["links"][link] for r in rows if r["variant"] == "none" for link in r.get("links", {})}
    base_row = {r["layout"]: r for r in rows if r["variant"] == "none"}
    head = " | ".join(f"{link} step s (x none, planner)" for link in rates)
    lines = [f"| layout | variant | MB across a step (x none) | {head} | held-out loss (x none) |",
             "|---|---|---|" + "---|" * len(rates) + "---|"]
    for r in rows:
        if "refused" in r:
            lines.append(f"| {r['layout']} | {r['variant']} | refused: {r['refused'].split(':')[1].strip()[:90]} |"
                         + " |" * len(rates) + " |")
            continue
        links = r.get("links", {})
        first = links.get(rates[0])
        b0 = base.get((r["layout"], rates[0]))
        across = "" if first is None else f"{first['bytes_across']['up'] / 1e6:.2f} ({first['bytes_across']['up'] / b0['bytes_across']['up']:.3f})"
        cells = []
        for link in rates:
            x, b = links.get(link), base.get((r["layout"], link))
            cells.append("" if x is None else f"{x['step_s']:.3f} ({b['step_s'] / x['step_s']:.2f}x, "
                         f"{x['predicted_s'] / x['step_s'] - 1:+.0%})")
        loss_s, loss_x = held_out(r, base_row.get(r["layout"]))
        held = loss_s + (f" ({loss_x})" if loss_x else "")
        lines.append(f"| {r['layout']} | {r['variant']} | {across} | {' | '.join(cells)} | {held} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="100mbit,200mbit")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"of {', '.join(LAYOUTS)}")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}; 'none' first "
                    "(the ratios and the uncompressed calibration read it)")
    ap.add_argument("--rows", default="", help="instead of --layouts x --variants: layout:variant pairs, e.g. "
                    "p1-z3:hpz,p2-zb-v-z3:w8")
    ap.add_argument("--steps", type=int, default=7, help="steps of each cluster run (>= 5: steps 3..n-1 are measured)")
    ap.add_argument("--repeat-compute", type=int, default=2, help="compute-only runs of each row; the fastest counts")
    ap.add_argument("--loss-steps", type=int, default=300, help="steps of each held-out loss run (0: none)")
    ap.add_argument("--seeds", type=lambda x: [int(v) for v in x.split(",")], default=[DEFAULT_SEED],
                    help="held-out loss runs at each of these seeds (weights and data order), compared seed by seed")
    ap.add_argument("--no-cluster", action="store_true", help="only the held-out loss runs (no root needed)")
    ap.add_argument("--no-pin", dest="pin", action="store_false")
    ap.add_argument("--name", default="cluster_compressed")
    ap.add_argument("--table", default="", help="measure nothing: merge these result files (comma-separated), "
                    "predict again with today's planner, print the table and write <name>.json")
    args = ap.parse_args()
    if args.table:
        got = merged([Path(x) for x in args.table.split(",")])
        rates = [r for r in args.rates.split(",") if r]
        print(table(got["rows"], rates))
        print(compact_table(got["rows"], rates))
        calib = next((r for r in got["rows"] if r["layout"] == "p2-1f1b-z3" and r["variant"] == "none"
                      and r.get("mfu")), None)
        if calib:
            got["plan_picks"] = {link: plan_picks(calib["mfu"], calib["probes"], link) for link in rates}
            for link, picks in got["plan_picks"].items():
                for name, best in picks.items():
                    print(f"plan at {link}, options {name}: " + "; ".join(
                        f"{b['layout']} {b['step_s']:.3f} s, {b['crossing_mb']:.1f} MB across" for b in best))
        (RESULTS / f"{args.name}.json").write_text(json.dumps({"merged_from": args.table, **got}, indent=2))
        print(f"wrote {RESULTS / args.name}.json")
        return
    pairs = [x.split(":") for x in args.rows.split(",") if x]
    unknown = [x for x in args.layouts.split(",") if x not in LAYOUTS] + [
        x for x in args.variants.split(",") if x not in VARIANTS] + [
        ":".join(p) for p in pairs if len(p) != 2 or p[0] not in LAYOUTS or p[1] not in VARIANTS]
    if unknown or args.steps < 5:
        why = (f"unknown {', '.join(unknown)}: layouts are {', '.join(LAYOUTS)}, variants {', '.join(VARIANTS)}"
               if unknown else f"--steps {args.steps}: at least 5 (steps 3 to n-1 are measured)")
        print(f"cluster_compressed: error: {why}", file=sys.stderr)
        sys.exit(2)
    RESULTS.mkdir(exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        got = measure(args, Path(tmp))
    rates = [r for r in args.rates.split(",") if r]
    print(table(got["rows"], rates))
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    (RESULTS / f"{args.name}.json").write_text(json.dumps(
        {"args": vars(args), "uptime": uptime, "wall_s": time.monotonic() - started, **got}, indent=2))
    (RESULTS / f"{args.name}.partial.json").unlink(missing_ok=True)
    print(f"{uptime}\nwrote {RESULTS / args.name}.json in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
