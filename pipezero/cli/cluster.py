"""`pipezero cluster`: a run on emulated nodes of this machine (network namespaces joined by shaped
links), checked as `train` checks it before the nodes are built."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from pipezero.errors import ConfigError
from pipezero.cli.flags import flag_values
from pipezero.cli.train import auto_settings, check_out


def add_cluster_parser(sub: argparse._SubParsersAction, root: argparse.ArgumentParser) -> None:
    """`root`: the whole command line's parser, which reads the command every node runs."""
    c = sub.add_parser("cluster", allow_abbrev=False, help="run pipezero on an emulated multi-node cluster (root)",
                       description="Nodes as network namespaces joined by links shaped with tc tbf; each node "
                                   "starts its ranks with torchrun. Example: pipezero cluster --nodes 2 "
                                   "--ranks-per-node 2 --link 200mbit train --pp 2 --dp 2 --zero 2")
    c.add_argument("--nodes", type=int, required=True, help="emulated nodes")
    c.add_argument("--ranks-per-node", type=int, default=1, help="ranks (torchrun --nproc-per-node) a node")
    c.add_argument("--link", default="200mbit", help="each node's link rate, tc units (kbit, mbit, gbit), e.g. 200mbit")
    c.add_argument("--pin", action="store_true", help="give each node its own share of this host's cores, as "
                                                      "separate machines have (needs a core a node)")
    c.add_argument("command", nargs=argparse.REMAINDER,
                   help="the `train` command every node runs; its pp x dp must be --nodes x --ranks-per-node "
                        "(checked, with its data, before the cluster is built)")
    c.set_defaults(func=lambda args: cmd_cluster(args, root))


def cmd_cluster(args: argparse.Namespace, root: argparse.ArgumentParser) -> int:
    from pipezero.cluster import ClusterSpec, require_root, run_on_cluster
    from pipezero.launch import preflight

    if not args.command:
        raise ConfigError("pipezero cluster needs a command to run, e.g. `train --pp 2 --dp 2`")
    if args.ranks_per_node < 1:
        raise ConfigError(f"--ranks-per-node {args.ranks_per_node}: at least 1")
    spec = ClusterSpec(args.nodes, args.link, pin=args.pin)
    cfg, force = cluster_job(args.command, args.nodes * args.ranks_per_node, root,
                             f"--nodes {args.nodes} x --ranks-per-node {args.ranks_per_node}", args.ranks_per_node)
    require_root()
    from pipezero.rundir import refuse_folder, refuse_trials_name

    refuse_folder(cfg.run.out, cfg.run.resume, force)  # as node 0's rank 0 would: one line, not every node's report
    refuse_trials_name(cfg.run.out)
    check_out(cfg)
    # data, tokenizer, vocabulary, the split over nodes: once, not on every rank
    preflight(cfg, args.nodes * args.ranks_per_node, args.ranks_per_node)
    from pipezero.runtime.watch import relaying_requests

    with relaying_requests(cfg.run.out):  # node 0's rank 0 prints the report
        return run_on_cluster(spec, args.ranks_per_node, args.command)


def cluster_job(argv: Sequence[str], world: int, parser: argparse.ArgumentParser,
                shape: str, per_node: int = 1) -> tuple[Any, bool]:
    """The run every node's ranks would start (its config, and whether it has --force), checked
    here as `train` checks it, before the cluster is built: a bad command caught on the nodes would
    end in every rank's torchrun report instead of one line. `parser`: the whole command line's."""
    from pipezero.settings import build_config, build_launch

    commands = next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if argv[0] in commands and argv[0] != "train":
        raise ConfigError(f"pipezero cluster runs `train` on every node, not `{argv[0]}`: e.g. pipezero cluster "
                          f"--nodes 2 train --dp 2")
    inner = parser.parse_args(list(argv))  # a mistake in it: one line here, not every node's
    settings, launch, names = flag_values(inner)
    if build_launch(launch, names).nproc is not None:
        raise ConfigError("--nproc: the cluster starts --ranks-per-node ranks a node; drop --nproc")
    settings, _, _ = auto_settings(inner, settings, names, None, (world, per_node))  # --layout auto: its ranks
    cfg = build_config(inner.config, settings, names)
    if cfg.parallel.world_size != world:
        raise ConfigError(f"train's pp x dp = {cfg.parallel.world_size} but the cluster runs {shape} = {world} "
                          f"ranks; make them equal")
    return cfg, bool(inner.force)

