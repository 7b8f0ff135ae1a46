"""A real Slurm of several nodes on this one machine, for tests/test_slurm.py.

Debian's slurmd is built for one slurmd a host name (no --enable-multiple-slurmd; a second NodeName
with this host's name is "Duplicated NodeHostName"), so each node here is a host of its own: a
network namespace of `pipezero.cluster.EmulatedCluster` (its own address on a bridge, its own
ports) and a UTS namespace whose host name is the node's name, so slurmd finds its NodeName from
`hostname` as on a real machine (no -N). A mount namespace a node binds one hosts file over
/etc/hosts, naming every node's address: the ranks' rendezvous host (the first node's name) and
torchrun's endpoint resolve as on a cluster with DNS. munged stays in the host's namespaces: its
socket is a file, reached from every network namespace.

Namespaces are entered with `nsenter --net` and `unshare`, not `ip netns exec`: that one mounts a
fresh /sys, which hides /sys/fs/cgroup, and slurmd 22.05 stops at start without it ("No filesystem
mounted on /sys/fs/cgroup", "Unable to initialize cgroup plugin") even with proctrack/linuxproc.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from pipezero.cluster import ClusterSpec, EmulatedCluster, leftovers

REPO = Path(__file__).resolve().parent.parent
NETNS_DIR = Path("/var/run/netns")  # where `ip netns add` puts each namespace's handle
# Slurm's own ports: each node's network namespace is new, so nothing else holds them there
CTLD_PORT, SLURMD_PORT = 6817, 6818
# the links between nodes: a LAN's rate, so that the shaping never slows a tiny model's step
LINK = "1gbit"


def pids_marked(marker: str) -> list[int]:
    """Processes whose command line or environment holds `marker` (our state folder): the daemons,
    slurmstepd (started by slurmd, with its environment) and the job's ranks (sbatch --export=ALL)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            text = (entry / "cmdline").read_bytes() + (entry / "environ").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if marker.encode() in text:
            found.append(int(entry.name))
    return found


class LocalSlurm:
    """munged, slurmctld (on the first node) and one slurmd a node in the foreground, every file
    under `root`; `stop` cancels the jobs, ends the daemons and removes the namespaces, and
    `kill_leftovers` kills whatever of theirs is still alive."""

    def __init__(self, root: Path, names: list[str]) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.names = names  # host names, and Slurm's NodeName
        self.daemons: list[tuple[str, subprocess.Popen]] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.cluster = EmulatedCluster(ClusterSpec(nodes=len(names), link=LINK))
        self.tag = self.cluster.tag  # every namespace and link it makes starts with this
        self._namespaces = contextlib.ExitStack()

    def start(self) -> None:
        self._namespaces.enter_context(self.cluster)
        addrs = [self.cluster.address(i) for i in range(len(self.names))]
        subprocess.run(["bash", str(REPO / ".ci/setup_slurm.sh"), "conf", str(self.root), str(CTLD_PORT),
                        str(SLURMD_PORT), "1000", *(f"{n}={a}" for n, a in zip(self.names, addrs))],
                       check=True, timeout=30)
        (self.root / "hosts").write_text("127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in
                                                                           zip(self.names, addrs)))
        r = self.root
        self._daemon("munged", ["munged", "--foreground", "--force", f"--socket={r}/munge.socket",
                                f"--key-file={r}/munge.key", f"--pid-file={r}/munged.pid",
                                f"--log-file={r}/munged.log", f"--seed-file={r}/munged.seed"])
        self.wait_for(lambda: (r / "munge.socket").exists(), "munged's socket", 20)
        self._daemon("slurmctld", self.on_node(0, ["slurmctld", "-D", "-f", str(self.conf)]))
        for i, name in enumerate(self.names):
            self._daemon(f"slurmd-{name}", self.on_node(i, ["slurmd", "-D", "-f", str(self.conf)]))
        self.wait_for(lambda: self.ctl(["sinfo", "-h", "-N", "-o", "%T"]).split() == ["idle"] * len(self.names),
                      f"nodes {', '.join(self.names)} idle (sinfo)", 30)

    def on_node(self, node: int, cmd: list[str]) -> list[str]:
        """`cmd` on node `node`: in its network namespace, under its host name, with the nodes'
        hosts file (in a mount namespace of its own, so the host's /etc/hosts is untouched)."""
        setup = f'mount --bind {self.root}/hosts /etc/hosts && hostname {self.names[node]} && exec "$@"'
        return ["nsenter", f"--net={NETNS_DIR / self.cluster.namespace(node)}", "unshare", "--mount", "--uts",
                "sh", "-c", setup, "sh", *cmd]

    def _daemon(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / f"{name}.out", "wb")
        self.daemons.append((name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)))

    def wait_for(self, ready: Callable[[], bool], what: str, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not ready():
            dead = [name for name, p in self.daemons if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise AssertionError(f"local Slurm: no {what} after {seconds} s; ended: {dead}\n{self.logs()}")
            time.sleep(0.2)

    def logs(self) -> str:
        return "\n".join(f"--- {f.name}\n" + f.read_text(errors="replace")[-1500:]
                         for f in sorted(self.root.glob("*.out")) + sorted(self.root.glob("*.log")))

    def run(self, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """A Slurm client command from the first node's network (where slurmctld listens)."""
        return subprocess.run(["nsenter", f"--net={NETNS_DIR / self.cluster.namespace(0)}", *cmd],
                              env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=20)

    def ctl(self, cmd: list[str]) -> str:
        """`cmd`'s output, or nothing when it failed (slurmctld busy or starting)."""
        done = self.run(cmd)
        return done.stdout if done.returncode == 0 else ""

    def submit(self, script: Path, options: list[str], env: dict[str, str], args: list[str]) -> str:
        done = self.run(["sbatch", "--parsable", *options, str(script), *args], env)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().split(";")[0]

    def state(self, job: str) -> tuple[str, str]:
        """(JobState, ExitCode) of a job slurmctld still remembers (MinJobAge)."""
        fields = dict(f.split("=", 1) for f in self.ctl(["scontrol", "-o", "show", "job", job]).split() if "=" in f)
        return fields.get("JobState", "UNKNOWN"), fields.get("ExitCode", "")

    def wait(self, jobs: dict[str, str], seconds: float, marker: str) -> tuple[dict[str, tuple[str, str]], int]:
        """Each job's final (state, exit code), and the most processes seen at once with `marker`
        (proof that `pids_marked` sees the ranks); a job still running at the deadline fails the
        test naming it, and is cancelled in `stop`."""
        deadline, final, seen = time.monotonic() + seconds, {}, 0
        while len(final) < len(jobs):
            seen = max(seen, len(pids_marked(marker)))
            for name, job in jobs.items():
                state = self.state(job)
                if state[0] not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "UNKNOWN"):
                    final[name] = state
            if time.monotonic() > deadline:
                raise AssertionError(f"Slurm jobs {jobs} not done after {seconds} s: {final}\n{self.logs()}")
            time.sleep(0.5)
        return final, seen

    def stop(self) -> None:
        """Cancel every job and let each node's slurmstepd finish (it reports to slurmctld, through
        munged), then end the daemons, kill what is left, and remove the namespaces."""
        if self.daemons and all(p.poll() is None for _, p in self.daemons):
            self.ctl(["scancel", "--full", "--user", "root"])
            deadline = time.monotonic() + 20
            while (self.ctl(["squeue", "-h"]).strip() or self.steps()) and time.monotonic() < deadline:
                time.sleep(0.2)
        for _, p in reversed(self.daemons):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for name, p in reversed(self.daemons):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        deadline = time.monotonic() + 15  # slurmstepd and the ranks end on their own after scancel
        while pids_marked(str(self.root)) and time.monotonic() < deadline:
            time.sleep(0.2)
        self._namespaces.close()  # a process still in one keeps it alive: `left` names it, the fixture kills it

    def steps(self) -> list[int]:
        """The slurmstepd processes still alive on any node (each ends once its step has reported
        to slurmctld, its ranks ended)."""
        found = []
        for pid in pids_marked(str(self.root)):
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"slurmstepd"):
                    found.append(pid)
            except OSError:
                pass
        return found

    def kill_leftovers(self) -> None:
        """Whatever the daemons left behind must not outlive the test."""
        for pid in pids_marked(str(self.root)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def left(self) -> list[str]:
        """What a stopped Slurm must not leave: its processes, namespaces and links."""
        return [f"pid {pid}" for pid in pids_marked(str(self.root))] + leftovers(self.tag)
