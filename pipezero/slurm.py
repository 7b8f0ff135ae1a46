"""Slurm's task variables, read as the torchrun variables the ranks already understand.

Under `srun pipezero train` (one task a rank, no torchrun) every task would otherwise start as rank
0 of 1. Slurm already tells each task who it is: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and the
tasks per node; the rendezvous host is the step's first node. Turning these into RANK / WORLD_SIZE
/ LOCAL_RANK / LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT keeps one way of joining the process
group (env://) for torchrun and Slurm alike. Host lists are expanded here, not by `scontrol`, so a
rank needs no Slurm client on its PATH.

Under `srun torchrun` the workers see both torchrun's variables and their node's SLURM_PROCID:
torchrun's win, and nothing is read from Slurm.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

from pipezero.errors import ConfigError

PORT_BASE = 15000  # job ports lie in [15000, 25000): below Linux's ephemeral range (32768+)
PORT_SPAN = 10000

T = TypeVar("T")

# ASCII digits only: `\d`, str.isdigit and int() also take other scripts' digits, and int() a sign,
# spaces and underscores (`int(' 0_2')` is 2), none of which Slurm writes
_DIGITS = re.compile(r"[0-9]+")
_REPEAT = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")
NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")


def as_count(text: str) -> int:
    """A number as Slurm writes it (ASCII digits, nothing else), else a ValueError."""
    if not _DIGITS.fullmatch(text):
        raise ValueError("Slurm writes a number in the digits 0-9 only")
    return int(text)


def _split_top_level(text: str) -> list[str]:
    """Split at the commas outside brackets (those inside separate a bracket's ranges)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError("nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("']' without '['")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError("'[' without ']'")
    parts.append(text[start:])
    return parts


def _bracket_ranges(body: str) -> list[tuple[int, int, int]]:
    """`01-04,07` -> (1, 4, 2), (7, 7, 2): each range's first and last number and its width (Slurm
    pads each number as wide as the range's first)."""
    ranges = []
    for item in body.split(","):
        lo, sep, hi = item.partition("-")
        if not _DIGITS.fullmatch(lo) or (sep and not _DIGITS.fullmatch(hi)):
            raise ValueError(f"[{body}] holds {item!r}, not a number or a range N-M")
        last = int(hi) if sep else int(lo)
        if last < int(lo):
            raise ValueError(f"[{body}] has a descending range {item!r}")
        ranges.append((int(lo), last, len(lo)))
    return ranges


def _expand_one(pattern: str) -> Iterator[str]:
    """One host expression: literal text and bracket groups, every combination in order. Checked
    whole here, expanded lazily: `n[1-1000000000]` is one line to parse, not a billion names."""
    if not pattern:
        raise ValueError("an empty host name")
    pieces = re.split(r"(\[[^\]]*\])", pattern)
    groups = [_bracket_ranges(p[1:-1]) if p.startswith("[") else p for p in pieces if p]
    return _combinations(groups)


def _combinations(groups: list[str | list[tuple[int, int, int]]]) -> Iterator[str]:
    """Each name the groups spell, the first group varying slowest (itertools.product would first
    hold every group's values whole)."""
    if not groups:
        yield ""
        return
    head = [groups[0]] if isinstance(groups[0], str) else (
        str(n).zfill(width) for lo, hi, width in groups[0] for n in range(lo, hi + 1))
    for value in head:
        for rest in _combinations(groups[1:]):
            yield value + rest


def hosts(text: str) -> Iterator[str]:
    """Slurm's compressed host list (`gpu[01-04,07],cpu3`) as host names, in Slurm's order: every
    part checked at once (a ValueError), the names made as they are read."""
    parts = [_expand_one(part) for part in _split_top_level(text)]
    return itertools.chain.from_iterable(parts)


def expand_hostlist(text: str) -> list[str]:
    """Every host of Slurm's compressed host list, in order."""
    return list(hosts(text))


def _task_runs(text: str) -> list[tuple[int, int]]:
    """SLURM_TASKS_PER_NODE's form (`2(x3),1`) as (tasks, nodes) runs, unexpanded."""
    runs = []
    for item in text.split(","):
        m = _REPEAT.fullmatch(item)
        if not m or int(m.group(1)) < 1 or (m.group(2) and int(m.group(2)) < 1):
            raise ValueError(f"{item!r} is not N or N(xK) with N, K >= 1")
        runs.append((int(m.group(1)), int(m.group(2) or 1)))
    return runs


def tasks_per_node(text: str) -> list[int]:
    """SLURM_TASKS_PER_NODE's form (`2(x3),1`: three nodes of 2 tasks, then one of 1), one count a node."""
    return [tasks for tasks, nodes in _task_runs(text) for _ in range(nodes)]


def tasks_on_node(text: str, node: int) -> int | None:
    """The tasks of node `node` in SLURM_TASKS_PER_NODE's form, None past its nodes; found without
    expanding the runs (`2(x1000000000)` is one run, not a billion counts)."""
    for tasks, nodes in _task_runs(text):
        if 0 <= node < nodes:
            return tasks
        node -= nodes
    return None


def job_port(job_id: str) -> int:
    """The rendezvous port every task of one job computes alike, without talking to each other;
    consecutive jobs on one node get different ports."""
    return PORT_BASE + as_count(job_id) % PORT_SPAN


def _read(env: Mapping[str, str], name: str, parse: Callable[[str], T]) -> T:
    """`parse(env[name])`, a malformed value refused in one line naming the variable."""
    if name not in env:  # srun sets them all: one missing means they were set by hand
        raise ConfigError(f"{name} is not set, but SLURM_STEP_ID and SLURM_PROCID say this is a task of an srun "
                          f"step; run under srun, or unset the SLURM_ variables")
    try:
        return parse(env[name])
    except ValueError as e:
        shown = env[name] if len(env[name]) <= 80 else env[name][:77] + "..."
        raise ConfigError(f"{name}={shown!r} is not what Slurm sets ({str(e)[:200]}); "
                          f"run under srun, or unset it") from None


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    return next((n for n in names if env.get(n)), None)


def _local_world_size(env: Mapping[str, str]) -> tuple[int, str]:
    """This node's task count and the variable it came from: the step's layout by SLURM_NODEID,
    else --ntasks-per-node, else all tasks on one node."""
    layout = _first(env, ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"))
    if layout:
        node = _read(env, "SLURM_NODEID", as_count) if "SLURM_NODEID" in env else 0
        count = _read(env, layout, lambda text: tasks_on_node(text, node))
        if count is None:
            nodes = sum(n for _, n in _task_runs(env[layout]))
            raise ConfigError(f"SLURM_NODEID={node} but {layout}={env[layout]!r} lists {nodes} nodes")
        return count, layout
    if env.get("SLURM_NTASKS_PER_NODE"):
        return _read(env, "SLURM_NTASKS_PER_NODE", as_count), "SLURM_NTASKS_PER_NODE"
    return _read(env, "SLURM_NTASKS", as_count), "SLURM_NTASKS"


def _refuse_disagreement(env: Mapping[str, str], ours: dict[str, str], sources: dict[str, str]) -> None:
    """A RANK (or WORLD_SIZE, ...) set beside Slurm's with another value is a leftover of another
    launcher or an exported variable: which one is right cannot be guessed."""
    for name, value in ours.items():
        if name in env and env[name] != value:
            raise ConfigError(f"{name}={env[name]} but {sources[name]} says {value} for this srun task: unset "
                              f"{name} (srun numbers its tasks), or start the ranks with `srun torchrun`")


def _check_numbers(ours: dict[str, str], sources: dict[str, str]) -> None:
    """Ranks within the world and local ranks within the node: a task numbered past them would wait
    at the rendezvous for peers that never come (until --timeout), or index a device it lacks."""
    rank, world, local, local_world = (int(ours[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))
    if world < 1:
        raise ConfigError(f"{sources['WORLD_SIZE']}={world}: a step has at least one task; run under srun, or unset it")
    for name, value, bound in (("RANK", rank, world), ("LOCAL_RANK", local, local_world)):
        if not 0 <= value < bound:
            raise ConfigError(f"{sources[name]}={value} is not a task of {bound} ({sources[name.replace('RANK', 'WORLD_SIZE')]}"
                              f"); these are Slurm's variables: run under srun, or unset them")


def step_tasks(env: Mapping[str, str]) -> int:
    """The step's task count (SLURM_NTASKS), read as Slurm writes it."""
    return _read(env, "SLURM_NTASKS", as_count)


def in_srun_step(env: Mapping[str, str]) -> bool:
    """A task of an srun step (the batch script itself has SLURM_PROCID too, but no step)."""
    return "SLURM_STEP_ID" in env and "SLURM_PROCID" in env


def rank_variables(env: Mapping[str, str]) -> dict[str, str]:
    """The torchrun variables this process takes from Slurm: empty outside an srun step, under
    torchrun (its variables win), and for a step of one task (a lone process, or a `--nproc`
    launcher). MASTER_ADDR / MASTER_PORT given by the user are kept."""
    if "TORCHELASTIC_RUN_ID" in env or not in_srun_step(env):
        return {}
    local_world, layout = _local_world_size(env)
    ours = {"RANK": str(_read(env, "SLURM_PROCID", as_count)), "WORLD_SIZE": str(_read(env, "SLURM_NTASKS", as_count)),
            "LOCAL_RANK": str(_read(env, "SLURM_LOCALID", as_count)), "LOCAL_WORLD_SIZE": str(local_world)}
    sources = {"RANK": "SLURM_PROCID", "WORLD_SIZE": "SLURM_NTASKS", "LOCAL_RANK": "SLURM_LOCALID",
               "LOCAL_WORLD_SIZE": f"the tasks per node ({layout})"}
    _check_numbers(ours, sources)
    _refuse_disagreement(env, ours, sources)
    if ours["WORLD_SIZE"] == "1":
        return {}
    if "MASTER_PORT" in env and not (_DIGITS.fullmatch(env["MASTER_PORT"]) and 1 <= int(env["MASTER_PORT"]) <= 65535):
        raise ConfigError(f"MASTER_PORT={env['MASTER_PORT'][:80]!r} is not a port (1 to 65535): set a free port, or "
                          f"unset it (the job's port then follows SLURM_JOB_ID)")
    nodes = _first(env, NODELISTS)
    if not env.get("MASTER_ADDR") and not nodes:  # env:// needs a host: an empty MASTER_ADDR names none
        said = "is empty" if "MASTER_ADDR" in env else "is not set"
        raise ConfigError(f"MASTER_ADDR {said} and no SLURM_STEP_NODELIST or SLURM_JOB_NODELIST names the step's "
                          f"nodes: set MASTER_ADDR to the host of rank 0")
    if "MASTER_PORT" not in env and not env.get("SLURM_JOB_ID"):
        raise ConfigError("an srun task without SLURM_JOB_ID: set MASTER_PORT for the rendezvous")
    return {**ours,
            "MASTER_ADDR": env.get("MASTER_ADDR") or _read(env, nodes, lambda text: next(hosts(text))),
            "MASTER_PORT": env.get("MASTER_PORT") or str(_read(env, "SLURM_JOB_ID", job_port))}


def master_from(env: Mapping[str, str]) -> str | None:
    """The node-list variable whose first node MASTER_ADDR is (rank_variables took it from there),
    or None where the user set MASTER_ADDR: a message then names what the user can change."""
    nodes = _first(env, NODELISTS)
    if not (in_srun_step(env) and nodes):
        return None
    try:
        first = next(hosts(env[nodes]))
    except (ValueError, StopIteration):
        return None
    return nodes if first == env.get("MASTER_ADDR") else None


def master_named(env: Mapping[str, str]) -> str:
    """MASTER_ADDR as a message names it: `gpu07, the first node of SLURM_STEP_NODELIST`, or
    `MASTER_ADDR='10.0.0.5'`."""
    addr = env.get("MASTER_ADDR", "")
    nodes = master_from(env)
    return f"{addr}, the first node of {nodes}" if nodes else f"MASTER_ADDR={addr[:80]!r}"


def start_ranks_advice(env: Mapping[str, str], ranks: int) -> str:
    """How to start `ranks` ranks where this process was started: srun's task count inside a step
    (--nproc is refused there), torchrun's options under torchrun, else --nproc."""
    if "TORCHELASTIC_RUN_ID" in env:
        return f"start {ranks} ranks with torchrun (--nnodes x --nproc-per-node = {ranks})"
    if in_srun_step(env):
        return f"run the step with `srun --ntasks {ranks}` (one task a rank)"
    return f"use --nproc {ranks}"


def ranks_per_node_advice(env: Mapping[str, str], most: int) -> str:
    """How to put at most `most` ranks on a machine, said for the launcher in use."""
    if in_srun_step(env) and "TORCHELASTIC_RUN_ID" not in env:
        return f"run the step with at most `srun --ntasks-per-node {most}`"
    return f"start at most {most} ranks a machine (--nproc / torchrun --nproc-per-node)"


def rendezvous_advice(env: Mapping[str, str]) -> str:
    """What to check when the ranks' rendezvous failed, said for the launcher in use."""
    if in_srun_step(env) and "TORCHELASTIC_RUN_ID" not in env:
        named = master_named(env) + ("," if master_from(env) else "")
        return (f"if the ranks never met, check that {named} is reachable from every node of the step and its port "
                f"free, or set MASTER_ADDR and MASTER_PORT")
    return "if the ranks never met, check MASTER_ADDR and MASTER_PORT, or let --nproc start them"
