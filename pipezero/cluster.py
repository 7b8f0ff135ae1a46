"""An emulated cluster on one machine: nodes are network namespaces, joined by shaped links.

Real clusters have fast links inside a node and slower ones between nodes, which loopback cannot
show. Here each node is a network namespace with one interface, `eth0`, a veth pair whose other
end sits on a bridge in the host's namespace. Ranks of one node share its namespace, so their
traffic to each other never leaves it (the kernel's loopback path: fast), while traffic between
nodes crosses two veth ends, each shaped by a token bucket filter (`tc qdisc ... tbf`): the node's
uplink (`eth0`'s egress) and its downlink (the bridge end's egress) both run at `link`. Every node
starts its ranks with torchrun exactly as on real machines (static rendezvous at node 0's address,
`--node-rank i`), so nothing in the engine knows the cluster is emulated.

Needs root and iproute2 (`ip`, `tc`). Everything it creates is named with a tag of this process
(`pz<pid>`), so two clusters never collide, and removed on exit, on failure and on Ctrl-C; what a
cluster killed with SIGKILL left behind, the next one removes (`remove_stale`).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from pipezero.errors import ConfigError
from pipezero.launch import SAFE_PATH
from pipezero.job import children
from pipezero.lifeline import bind_child


# a tc rate in bits a second (tc reads `bps` as bytes a second: accepted, as tc does)
RATE = re.compile(r"([0-9]+(?:\.[0-9]+)?)([kmgt]i?)?(bit|bps)")  # ASCII digits: tc reads no others
MIN_RATE = 8  # bits a second: tc keeps a rate in whole bytes a second, and reads less than one as none
MAX_RATE = 10e12  # bits a second: 10tbit, past any link there is to emulate; tc failed mid-build on 2**70gbit


def rate_bits(link: str) -> float | None:
    """A tc rate in bits a second, or None if `link` is not one."""
    if not (m := RATE.fullmatch(link)):
        return None
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
    return float(m[1]) * scale[m[2] or ""] * (8 if m[3] == "bps" else 1)


UNWIND = (signal.SIGTERM, signal.SIGHUP)  # signals that end a cluster as Ctrl-C does, tearing it down


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


class ClusterError(RuntimeError):
    """The host could not build or run the emulated cluster (a failed `ip` or `tc` command)."""


@dataclass(frozen=True)
class ClusterSpec:
    nodes: int
    link: str = "200mbit"  # each node's uplink and downlink rate (tc units: kbit, mbit, gbit)
    # tbf's bucket: larger than one TCP segmentation-offload packet (64 KB of payload plus headers),
    # which then crosses whole as a NIC's offload would send it; at 64kb tbf cut each such packet into
    # MTU-sized ones in softirq (measured: 6-7 host CPU-seconds a GB crossing against about 1, the
    # cost that stretched a rank's compute beside its traffic). Small enough that the rate holds
    # over ~10 ms at 100mbit. And how long a packet may queue before tbf drops it.
    burst: str = "128kb"
    queue_ms: int = 50
    # each node's processes on cores of its own, as on separate machines: without it the host's
    # scheduler lets one node's compute take another node's cores (measured: a rank whose backward
    # runs late holds up every collective of its peers)
    pin: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= 200:
            raise ConfigError(f"--nodes {self.nodes}: choose 1 to 200")
        bits = rate_bits(self.link)
        if bits is None or not MIN_RATE <= bits <= MAX_RATE:  # tc would fail mid-build, after the namespaces were made
            raise ConfigError(f"--link {self.link!r}: a tc rate such as 200mbit (a number, then kbit, mbit, gbit "
                              f"or bit; tc's bps units are bytes a second), at least 8bit and at most 10tbit")
        if self.pin and self.nodes > len(os.sched_getaffinity(0)):
            raise ConfigError(f"--pin: {self.nodes} nodes need a core each and this host lends "
                              f"{len(os.sched_getaffinity(0))}; leave out --pin or use fewer nodes")


def node_cores(cores: Sequence[int], nodes: int, node: int) -> list[int]:
    """Node `node`'s equal share of `cores` (the first ones go to the first nodes)."""
    per = len(cores) // nodes
    return sorted(cores)[node * per:(node + 1) * per]


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise ClusterError(f"`{' '.join(cmd)}` failed: {done.stderr.strip() or done.returncode}")


# what `ip` and `tc` need: links, addresses and qdiscs (NET_ADMIN), a namespace's mount (SYS_ADMIN)
RIGHTS = {"CAP_NET_ADMIN": 12, "CAP_SYS_ADMIN": 21}


def missing_rights(status: str | None = None) -> list[str]:
    """The capabilities of RIGHTS this process lacks, from /proc/self/status's CapEff (`status`: its
    text). Root in a default container has neither, so `ip` failed there after the euid check passed."""
    if status is None:
        try:
            status = Path("/proc/self/status").read_text()
        except OSError:  # not Linux: `ip` itself will say
            return []
    held = next((int(line.split()[1], 16) for line in status.splitlines() if line.startswith("CapEff:")), 0)
    return [name for name, bit in RIGHTS.items() if not held >> bit & 1]


def require_root() -> None:
    """One line, before anything is created, when this host cannot build namespaces."""
    if os.geteuid() != 0:
        raise ConfigError("the emulated cluster needs root (network namespaces, veth, tc): run as root")
    lacking = missing_rights()
    if lacking:
        raise ConfigError(f"this root lacks {' and '.join(lacking)}, which network namespaces, veth and tc need "
                          f"(a default container's root has neither): run the container with --cap-add NET_ADMIN "
                          f"--cap-add SYS_ADMIN, or --privileged")
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        raise ConfigError(f"the emulated cluster needs iproute2's {' and '.join(missing)}: install iproute2")


class EmulatedCluster:
    """Build the namespaces and links on enter, tear everything down on exit (processes first)."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        pid = os.getpid()
        self.tag = f"pz{pid % 100000}"
        self.subnet = f"10.213.{pid % 250}"  # one /24 a cluster; node i is .(i + 1)
        self.procs: list[subprocess.Popen[bytes]] = []
        self._made: list[tuple[str, ...]] = []  # teardown commands, run in reverse

    def namespace(self, node: int) -> str:
        return f"{self.tag}n{node}"

    def address(self, node: int) -> str:
        return f"{self.subnet}.{node + 1}"

    def host_end(self, node: int) -> str:
        return f"{self.tag}v{node}"

    def __enter__(self) -> "EmulatedCluster":
        require_root()
        if removed := remove_stale():
            print(f"pipezero: removed what a cluster stopped without its teardown (kill -9) left behind: "
                  f"{', '.join(removed)}", file=sys.stderr, flush=True)
        # SIGTERM (`timeout`, `kill`, a scheduler) and SIGHUP (a closed terminal or ssh session) would
        # end the interpreter without `finally`, leaving namespaces and ranks behind: they unwind like
        # Ctrl-C instead, while this is open
        self._before: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            self._before = {sig: signal.signal(sig, _interrupt) for sig in UNWIND
                            if signal.getsignal(sig) is not signal.SIG_IGN}  # nohup's choice kept
        try:
            self._build()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for sig in self._before:
            signal.signal(sig, signal.SIG_IGN)  # a second one must not cut the teardown short
        try:
            self.close()
        finally:
            for sig, handler in self._before.items():
                signal.signal(sig, handler)  # type: ignore[arg-type]

    def _build(self) -> None:
        bridge, s = f"{self.tag}b", self.spec
        _run("ip", "link", "add", bridge, "type", "bridge")
        self._made.append(("ip", "link", "del", bridge))
        _run("ip", "link", "set", bridge, "up")
        for i in range(s.nodes):
            ns, host = self.namespace(i), self.host_end(i)
            _run("ip", "netns", "add", ns)
            self._made.append(("ip", "netns", "del", ns))
            _run("ip", "link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._made.append(("ip", "link", "del", host))  # the pair goes with it, at once
            _run("ip", "link", "set", host, "master", bridge, "up")
            inside = ("ip", "netns", "exec", ns)
            _run(*inside, "ip", "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _run(*inside, "ip", "link", "set", "eth0", "up")
            _run(*inside, "ip", "link", "set", "lo", "up")
            shape = ("root", "tbf", "rate", s.link, "burst", s.burst, "latency", f"{s.queue_ms}ms")
            _run(*inside, "tc", "qdisc", "add", "dev", "eth0", *shape)  # uplink
            _run("tc", "qdisc", "add", "dev", host, *shape)  # downlink

    def start(self, node: int, argv: Sequence[str], env: dict[str, str] | None = None,
              **popen: object) -> subprocess.Popen[bytes]:
        """Run `argv` inside node `node`'s namespace, in a session of its own (so it can be
        stopped as a whole)."""
        cores = node_cores(list(os.sched_getaffinity(0)), self.spec.nodes, node) if self.spec.pin else None
        # set in the child before exec: everything it starts inherits the mask
        pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
        # `ip netns exec` execs argv in its own process: a torchrun agent (pipezero.loopback) started
        # so dies with this one whatever ends it, SIGKILL included (lifeline.py), and its ranks with it
        child_env = {**os.environ, **(env or {})}
        bind_child(child_env)
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespace(node), *argv], preexec_fn=pin,
                                env=child_env, start_new_session=True, **popen)  # type: ignore[call-overload]
        self.procs.append(proc)
        return proc

    def torchrun(self, node: int, ranks_per_node: int, port: int, args: Sequence[str], max_restarts: int = 0,
                 **popen: object) -> subprocess.Popen[bytes]:
        """torchrun on node `node` for a job of every node: static rendezvous at node 0, so node
        i holds global ranks [i * ranks_per_node, (i + 1) * ranks_per_node). With `max_restarts`,
        each node's agent restarts its ranks when one fails (a cut link fails every rank within
        --timeout, so all nodes restart, and meet again at node 0 once the link is back). Started as
        pipezero.loopback, torchrun whose failed job ends in one line, not its traceback."""
        cmd = [sys.executable, "-P", "-m", "pipezero.loopback", f"--nnodes={self.spec.nodes}",
               f"--nproc-per-node={ranks_per_node}", f"--node-rank={node}", f"--master-addr={self.address(0)}",
               f"--master-port={port}", f"--local-addr={self.address(node)}", f"--max-restarts={max_restarts}",
               *args]
        # gloo picks its interface by name: eth0 is this node's address (traffic between two ranks
        # of one node to that address stays inside the namespace, unshaped).
        env = {**SAFE_PATH, "GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0",
               "OMP_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) // (ranks_per_node * self.spec.nodes)))}
        return self.start(node, cmd, env, **popen)

    def cut(self, node: int) -> None:
        """Take node `node`'s link down (its ranks can no longer reach any other node)."""
        _run("ip", "link", "set", self.host_end(node), "down")

    def mend(self, node: int) -> None:
        _run("ip", "link", "set", self.host_end(node), "up")

    def close(self) -> None:
        """Stop every process started here, then remove every namespace and link, newest first."""
        for proc in self.procs:
            # torchrun starts every worker in a session of its own: find them all before killing
            for pid in [*descendants(proc.pid), proc.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
        self.procs.clear()
        errors = []
        while self._made:
            cmd = self._made.pop()
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                errors.append(f"`{' '.join(cmd)}`: {done.stderr.strip()}")
        if errors:
            raise ClusterError("could not remove: " + "; ".join(errors))


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children first found, grandchildren after)."""
    found, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        found += kids
        todo += kids
    return found


def leftovers(tag: str) -> list[str]:
    """Namespaces and links of the cluster tagged `tag` (what a closed cluster must not leave): its
    bridge, namespaces and host-side ends exactly, not another cluster's whose tag merely starts
    alike (pz123 and pz1234 may be built at once by two test workers)."""
    names = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found = [line.split(":")[1].strip().split("@")[0] for line in names.splitlines()]
    found += [line.split()[0] for line in spaces.splitlines() if line.strip()]
    mine = re.compile(re.escape(tag) + r"[bnv]\d*")
    return [n for n in found if mine.fullmatch(n)]


TAGGED = re.compile(r"pz(\d+)[bnv]\d*")  # a cluster's bridge, namespaces and host-side veth ends


def _owner_lives(tag_number: int) -> bool:
    """Whether a process that could have built the cluster tagged pz<tag_number> still runs: any
    process but this one whose pid ends so (the tag keeps a pid's last five digits), so that another
    live cluster's namespaces are never taken for stale ones."""
    mine = os.getpid()
    return any(int(p) % 100000 == tag_number and int(p) != mine for p in os.listdir("/proc") if p.isdigit())


def _holds_processes(namespace: str) -> bool:
    done = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return bool(done.stdout.strip())


def remove_stale() -> list[str]:
    """Remove the namespaces and links of clusters whose builder is gone without its teardown (a
    `kill -9` runs no `finally`), and return their names: left there, they pile up, and a later
    cluster whose pid ends alike fails to build on a name taken. A cluster whose builder may still
    run, or whose namespaces still hold a process, is left alone."""
    shown = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = [line.split(":")[1].strip().split("@")[0] for line in shown.splitlines() if line.count(":") >= 2]
    namespaces = [line.split()[0] for line in spaces.splitlines() if line.strip()]
    found = [(m[0], link, int(m[1])) for names, link in ((links, True), (namespaces, False)) for n in names
             if (m := TAGGED.fullmatch(n))]  # (name, a link or a namespace, its cluster's tag)
    busy = {tag for name, link, tag in found if not link and _holds_processes(name)}
    stale = {tag for tag in {t for _, _, t in found} - busy if not _owner_lives(tag)}
    removed = []
    for name, link, tag in sorted(found, key=lambda f: not f[1]):  # links first: a veth pair goes with its host end
        if tag in stale:
            done = subprocess.run(["ip", "link", "del", name] if link else ["ip", "netns", "del", name],
                                  capture_output=True, text=True)
            if done.returncode == 0:
                removed.append(name)
    return removed


def launcher_restarts(argv: Sequence[str]) -> tuple[int, list[str]]:
    """`--max-restarts N` of a `train` command is torchrun's (each node's agent): its value, and
    the command without it (the ranks never see launcher flags)."""
    from pipezero.launch import strip_launcher_flags

    text = "0"
    for i, a in enumerate(argv):
        if a == "--max-restarts" and i + 1 < len(argv):
            text = argv[i + 1]
        elif a.startswith("--max-restarts="):
            text = a.split("=", 1)[1]
    if not text.isdigit():
        raise ConfigError(f"--max-restarts {text}: a whole number, 0 or more")
    n = int(text)
    return n, strip_launcher_flags(argv)


def run_on_cluster(spec: ClusterSpec, ranks_per_node: int, argv: Sequence[str], port: int = 29500) -> int:
    """`pipezero cluster`: run `pipezero <argv>` on every node of a fresh emulated cluster and return
    the job's exit status (the worst node's). SIGINT and SIGTERM tear everything down."""
    try:
        with EmulatedCluster(spec) as cluster:
            print(f"pipezero: {spec.nodes} emulated nodes x {ranks_per_node} ranks at {spec.link} a link "
                  f"({cluster.address(0)}..{cluster.address(spec.nodes - 1)})", file=sys.stderr, flush=True)
            restarts, argv = launcher_restarts(argv)
            agents = [cluster.torchrun(i, ranks_per_node, port, ["-m", "pipezero.cli", *argv], restarts)
                      for i in range(spec.nodes)]
            return max(a.wait() for a in agents)
    except KeyboardInterrupt:
        print("pipezero: stopped; the emulated cluster is removed", file=sys.stderr, flush=True)
        return 130
    except ClusterError as e:  # `ip` or `tc` refused a step (a rate tc cannot shape, a name taken): one line
        print(f"pipezero: error: the emulated cluster failed: {e}", file=sys.stderr, flush=True)
        return 1
