"""The hang doctor: from every rank's flight record (runtime/flight.py) and the compiled plan, which
rank (or link) holds everyone up, and at which instruction.

Each rank that can still answer writes its record to `RUN/doctor/rank-NNNNN.json` (runtime/watch.py)
when one of its waits passes the stall threshold or fails, or when a report is asked for (SIGUSR1 to
the launcher). A record says where the rank is (step, instruction index) and what it waits for, in
the plan's terms: a transfer from a peer, or a collective of its data-parallel group or the world.
The programs of every rank are compiled here from the plan facts a record carries (the layout and
the model's shapes, schedules/compile.py), so each wait can be matched with the instruction of the peer that
must happen for it to end: the peer's SEND of that transfer, or its own turn at that collective. A
peer that has not reached that instruction holds the waiter up; following who-holds-up-whom ends at
the rank whose next action never happened (no record: stopped or dead; or not waiting: stuck in
its own work), at a link (the peer passed its SEND, the data never came), or in a cycle (the plan's
order broken). A SEND the program passed without posting anything is named first: after it, a
peer's tag-less receives match the wrong sends, and every later wait is a consequence.

`verdict` and `table` are pure functions of records and programs, tested with synthetic records.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pipezero.config import GradReduce, ParallelConfig, Placement, ScheduleKind, Zero3Unit
from pipezero.flight_files import FOLDER, Record, RecordError, read_run, record_path
from pipezero.schedules.compile import compile_plan
from pipezero.schedules.model_shapes import ModelShapes
from pipezero.schedules.program import Compute, Instr, Kind, PointToPoint, Program

REQUEST = "request"  # its content: the time a report was asked for
Position = tuple[int, int]  # (step, instruction index)
PAST = 1 << 30  # index of a rank outside its program after a step: past every instruction of it


# --- the plan -------------------------------------------------------------------------------------
def check_size(facts: dict[str, Any]) -> None:
    """A record is data on disk: its layout within what train runs (schedules/limits.py), or the
    ValueError cmd_doctor reports (an edited record of pp = 10^9 lowered programs for ever)."""
    from pipezero.schedules import limits

    sizes = {k: facts[k] for k in ("pp", "dp", "microbatches", "virtual_stages")}
    if not all(type(v) is int and v >= 1 for v in sizes.values()):
        raise ValueError(f"plan sizes {sizes}: positive integers only")
    world, played = sizes["pp"] * sizes["dp"], sizes["pp"] * sizes["microbatches"] * sizes["virtual_stages"]
    if world not in limits.GPUS or played > limits.TRAIN_PLAY_LIMIT:
        raise ValueError(f"plan sizes {sizes}: past what train runs ({limits.GPUS.high:g} ranks, "
                         f"{limits.TRAIN_PLAY_LIMIT} stage micro-batches a step)")


def programs(facts: dict[str, Any]) -> Program:
    """The programs of one data-parallel replica (replica 0) of every stage, compiled from the plan
    facts a record carries (runtime/watch.py): every other rank's is its stage's but for the peers
    it names (`Programs`), so the doctor lowers P programs, not P x D."""
    check_size(facts)
    depth = facts.get("zero3_prefetch", 1)  # records written before the prefetch depth: 1
    if type(depth) is not int or not 1 <= depth <= 64:
        raise ValueError(f"zero3_prefetch {depth!r}: a whole number of layers from 1 to 64 only")
    if type(facts["zero"]) is not int or facts["zero"] not in range(4):  # a key of the lowering's tables
        raise ValueError(f"zero {facts['zero']!r}: a ZeRO stage, 0 to 3 only")
    unit = facts.get("zero3_unit", Zero3Unit.LAYER.value)  # records written before the unit: whole layers
    if unit not in {u.value for u in Zero3Unit}:
        raise ValueError(f"zero3_unit {unit!r}: one of {', '.join(u.value for u in Zero3Unit)} only")
    p = ParallelConfig(pp=facts["pp"], dp=facts["dp"], zero=facts["zero"], schedule=ScheduleKind(facts["schedule"]),
                       microbatches=facts["microbatches"], virtual_stages=facts["virtual_stages"],
                       grad_reduce=GradReduce(facts["grad_reduce"]), bucket_mb=facts["bucket_mb"],
                       zero3_keep_gathered=facts["zero3_keep_gathered"], recompute=facts["recompute"],
                       zero3_prefetch=depth, zero3_unit=Zero3Unit(unit))
    return compile_plan(p, ModelShapes.from_json(facts["model"]), replicas=(0,)).program


@dataclass(frozen=True)
class Ranks:
    """Global ranks <-> program slots (`Program.ranks[pp_rank * dp + dp_rank]`), by placement."""

    pp: int
    dp: int
    placement: str = Placement.DP_INNER.value

    def coords(self, rank: int) -> tuple[int, int]:
        if self.placement == Placement.DP_INNER.value:
            return divmod(rank, self.dp)
        d, p = divmod(rank, self.pp)
        return p, d

    def slot(self, rank: int) -> int:
        p, d = self.coords(rank)
        return p * self.dp + d

    def rank(self, slot: int) -> int:
        p, d = divmod(slot, self.dp)
        return p * self.dp + d if self.placement == Placement.DP_INNER.value else d * self.pp + p

    @property
    def world(self) -> int:
        return self.pp * self.dp

    @classmethod
    def of(cls, facts: dict[str, Any]) -> Ranks:
        return cls(facts["pp"], facts["dp"], facts.get("placement", Placement.DP_INNER.value))


def position(rec: Record) -> Position:
    """Where a rank is: outside its program after step s (evaluation, checkpoint) is past step s."""
    if rec["index"] >= 0:
        return rec["step"], rec["index"]
    return (rec["step"], PAST) if rec["step"] > 0 else (0, -1)


def _matches(ins: Instr, aw: dict[str, Any]) -> int:
    """How many times instruction `ins` is the collective `aw` names (layer by layer, a compute
    instruction holds its gathers, a bucket's possibly twice)."""
    if isinstance(ins, Compute):
        return sum(_matches(d, aw) for d in ins.during)
    return int(_matches_one(ins, aw))


def _shown(ins: Instr, awaited: list[dict[str, Any]]) -> str:
    """An instruction as the verdict names it: a compute instruction with the collective inside it
    that the waiters wait for (`0BW3 (REDUCE_GRAD(0.1)@grads 1)`)."""
    inside = [d for d in getattr(ins, "during", ()) if any(_matches_one(d, aw) for aw in awaited)]
    return f"{ins} ({inside[0]})" if inside else str(ins)


def _matches_one(ins: Instr, aw: dict[str, Any]) -> bool:
    if ins.kind.value != aw["op"]:
        return False
    if aw["op"] == Kind.OPTIM_STEP.value:
        return True
    bucket = getattr(ins, "bucket", None)
    return ins.chunk == aw.get("chunk") and (bucket is None or aw.get("bucket") is None or bucket == aw["bucket"])


Holder = tuple[int, Position]  # a peer, and the position in its program it must reach
Need = tuple[int, int, int, tuple[Any, Any, Any]]  # a collective: (stage or -1: the world, step, nth, what)


class Programs:
    """Every rank's program, read from its stage's replica-0 program (`programs`): a rank of
    replica d plays that program with each transfer's peer moved to replica d. What a wait looks
    up in them (the peer's matching SEND or RECV, the group's turns at a collective) is indexed
    once a stage: a 65,536-rank run's records each look one up, and a scan of a program for each
    made the doctor's time grow as records times ranks."""

    def __init__(self, program: Program, ranks: Ranks) -> None:
        self.program, self.ranks = program, ranks
        self._transfers: dict[int, dict[tuple[Kind, Any, int], int]] = {}
        self._hits: dict[tuple[int, Any, Any, Any], tuple[int, ...]] = {}

    def coords(self, rank: Any) -> tuple[int, int]:
        """(stage, replica) of a rank a record names; a number outside the run is the record's error."""
        if type(rank) is not int or not 0 <= rank < self.ranks.world:
            raise ValueError(f"rank {rank!r} named in a record: not a rank of this {self.ranks.world}-rank run")
        return self.ranks.coords(rank)

    def _stage_program(self, stage: int) -> tuple[Instr, ...]:
        return self.program.ranks[stage * self.ranks.dp]

    def instr(self, rank: int, j: int) -> Instr:
        """Instruction `j` of `rank`'s program."""
        stage, d = self.coords(rank)
        ins = self._stage_program(stage)[j]
        return replace(ins, peer=ins.peer + d) if d and isinstance(ins, PointToPoint) else ins

    def of(self, rank: int) -> list[Instr]:
        """`rank`'s whole program."""
        return [self.instr(rank, j) for j in range(len(self._stage_program(self.coords(rank)[0])))]

    def transfer(self, rank: int, kind: Kind, transfer: Any, peer: int) -> int | None:
        """Index of `rank`'s first `kind` (SEND or RECV) of `transfer` with `peer`, if it has one."""
        (stage, d), (peer_stage, peer_d) = self.coords(rank), self.coords(peer)
        if d != peer_d:  # transfers stay within a replica
            return None
        if stage not in self._transfers:
            found: dict[tuple[Kind, Any, int], int] = {}
            for j, ins in enumerate(self._stage_program(stage)):
                if isinstance(ins, PointToPoint):  # replica 0's peer slot is its stage times D
                    found.setdefault((ins.kind, ins.transfer, ins.peer // self.ranks.dp), j)
            self._transfers[stage] = found
        return self._transfers[stage].get((kind, transfer, peer_stage))

    def hits(self, rank: int, aw: dict[str, Any]) -> tuple[int, ...]:
        """Where in `rank`'s program the collective `aw` names happens, an index each time."""
        stage = self.coords(rank)[0]
        key = (stage, aw["op"], aw.get("chunk"), aw.get("bucket"))
        if key not in self._hits:
            self._hits[key] = tuple(j for j, ins in enumerate(self._stage_program(stage))
                                    for _ in range(_matches(ins, aw)))
        return self._hits[key]


def transfer_need(rec: Record, plans: Programs) -> list[Holder]:
    """What a wait on a transfer needs to end: the peer's matching SEND (of a RECV) or RECV (of a SEND)."""
    aw, me = rec["awaited"], rec["rank"]
    if rec["index"] < 0:
        return []  # a transfer outside the program (evaluation)
    want = Kind.SEND if aw["op"] == "RECV" else Kind.RECV
    j = plans.transfer(aw["peer"], want, tuple(aw["transfer"]), me)
    return [] if j is None else [(aw["peer"], (rec["step"], j))]


def collective_need(rec: Record, plans: Programs) -> Need | None:
    """Which turn at which collective a wait is: every rank of its group must reach the same turn."""
    aw = rec["awaited"]
    op = aw["op"]
    hits = plans.hits(rec["rank"], aw)
    step, upto = position(rec)
    done = sum(1 for j in hits if j <= upto)
    if done:  # the newest one started (older ones are waited for first)
        nth = done - 1
    elif hits and op == Kind.REDUCE_GRAD.value:  # started by autograd's hooks inside the backward before it
        nth = 0
    elif hits:  # started in the previous step's tail (ZeRO-1/2's gathers of updated weights)
        step, nth = step - 1, len(hits) - 1
    else:
        return None
    group = -1 if op == Kind.OPTIM_STEP.value else plans.coords(rec["rank"])[0]
    return group, step, nth, (op, aw.get("chunk"), aw.get("bucket"))


def group_turns(need: Need, aw: dict[str, Any], plans: Programs) -> list[Holder]:
    """Every rank of a collective's group, at its position of the turn `need` names."""
    group, step, nth, _ = need
    ranks = plans.ranks
    members = range(ranks.world) if group < 0 else [ranks.rank(group * ranks.dp + d) for d in range(ranks.dp)]
    turns = []
    for q in members:
        theirs = plans.hits(q, aw)
        if nth < len(theirs):
            turns.append((q, (step, theirs[nth])))
    return turns


def blocked(records: dict[int, Record], plans: Programs, min_wait_s: float
            ) -> tuple[dict[int, Sequence[Holder]], list[tuple[int, int, Position]]]:
    """Who holds each stuck rank up (waiter -> the peers that have not reached what it needs), and
    the transfers whose sender passed its SEND while the receiver still waits (sender, receiver,
    where). The ranks of a group that lag one turn of a collective are found once for all its
    waiters: with every rank of a large run waiting in the step's all-reduce, one list."""
    holds: dict[int, Sequence[Holder]] = {}
    links: list[tuple[int, int, Position]] = []
    lagging: dict[Need, tuple[tuple[Holder, ...], frozenset[int]]] = {}
    for r, rec in records.items():
        if not stuck(rec, min_wait_s):
            continue
        op = rec["awaited"]["op"]
        if op in ("RECV", "SEND"):
            for q, at in transfer_need(rec, plans):
                if q not in records or not reached(records[q], at):
                    holds.setdefault(r, []).append((q, at))  # type: ignore[attr-defined]
                elif op == "RECV":
                    links.append((q, r, at))
            continue
        if op not in (Kind.REDUCE_GRAD.value, Kind.UNSHARD.value, Kind.OPTIM_STEP.value):
            continue
        need = collective_need(rec, plans)
        if need is None:
            continue
        if need not in lagging:
            lag = tuple((q, at) for q, at in group_turns(need, rec["awaited"], plans)
                        if q not in records or not reached(records[q], at))
            lagging[need] = lag, frozenset(q for q, _ in lag)
        lag, behind = lagging[need]
        mine = tuple(h for h in lag if h[0] != r) if r in behind else lag
        if mine:
            holds[r] = mine
    return holds, links


def chain_ends(holds: dict[int, Sequence[Holder]]) -> tuple[dict[int, int], list[int]]:
    """Follow who-holds-up-whom from every waiter, the peer furthest behind first: the rank each
    chain ends at (waiter -> end), or the first cycle met. Each rank is walked once."""
    nearest: dict[int, int] = {}  # id of a holder list (shared by a group's waiters) -> its furthest behind
    nxt = {}
    for w, h in holds.items():
        if id(h) not in nearest:
            nearest[id(h)] = min(h, key=lambda x: x[1])[0]
        nxt[w] = nearest[id(h)]
    end: dict[int, int] = {}
    for start in holds:
        path: list[int] = []
        on: dict[int, int] = {}
        r = start
        while r in holds and r not in end:
            if r in on:
                return end, path[on[r]:] + [r]
            on[r] = len(path)
            path.append(r)
            r = nxt[r]
        root = end.get(r, r)
        for w in path:
            end[w] = root
    return end, []


def reached(rec: Record, at: Position) -> bool:
    """Whether the rank of `rec` has done (or is inside) the instruction at `at`."""
    pos = position(rec)
    return pos > at or (pos == at and (rec.get("awaited") is not None or rec.get("nbytes", 0) > 0))


# --- the verdict ----------------------------------------------------------------------------------
@dataclass
class Verdict:
    culprit: int | None  # the rank whose next action never happened; None: a link, a cycle or no hang
    link: tuple[int, int] | None = None  # (sender, receiver) whose transfer was sent and never arrived
    instruction: str = ""  # the culprit's instruction that never happened, as its program prints it
    index: int = -1  # its position in the culprit's program
    step: int = 0
    waiting: dict[int, str] = field(default_factory=dict)  # rank -> what it waits for because of it
    text: str = ""


def _awaited_text(rec: Record) -> str:
    aw = rec.get("awaited") or {}
    op = aw.get("op", "")
    if op == "RECV":
        chunk, grad, mb = aw["transfer"]
        return f"{'gradient' if grad else 'activation'} {chunk}:{mb} from rank {aw['peer']}"
    if op == "SEND":
        chunk, grad, mb = aw["transfer"]
        return f"send of {'gradient' if grad else 'activation'} {chunk}:{mb} to rank {aw['peer']}"
    if op == "OPTIM_STEP":
        return "OPTIM_STEP all-reduce (world)"
    if op in ("REDUCE_GRAD", "UNSHARD"):
        where = f"{aw['chunk']}" if aw.get("bucket") is None else f"{aw['chunk']}.{aw['bucket']}"
        return f"{op}({where}) (data-parallel group)"
    return str(aw.get("what", "")).split(": ", 1)[-1] if aw else ""


def _lost_transfer(link: tuple[int, int, Position], records: dict[int, Record], plans: Programs,
                   waiters: list[int]) -> Verdict:
    q, r, (step, j) = link
    ins = str(plans.instr(q, j))
    return Verdict(None, (q, r), ins, j, step, {w: _awaited_text(records[w]) for w in waiters},
                   f"link {q} -> {r}: rank {q} posted instruction {j} {ins} of step {step}, rank {r} never got it; "
                   f"{len(waiters)} rank(s) wait because of it")


def stuck(rec: Record, min_wait_s: float) -> bool:
    """A wait that failed, or has lasted `min_wait_s`: records of a moving run are taken moments
    apart, and a wait that just began says nothing about who holds whom up."""
    return bool(rec.get("awaited")) and (rec["state"] == "failed" or rec["waited_s"] >= min_wait_s)


def verdict(records: dict[int, Record], prog: Program, ranks: Ranks, min_wait_s: float = 0.5) -> Verdict:
    """Who holds everyone up, from the records of the ranks that answered and the programs
    (`programs`: one replica's suffices); waits shorter than `min_wait_s` (unless they failed) are
    no sign of a hang."""
    plans = Programs(prog, ranks)
    for r, rec in sorted(records.items()):  # a SEND passed without posting: everything after follows from it
        j = rec.get("unposted", -1)
        if j >= 0:
            ins = str(plans.instr(r, j))
            waiting = {q: _awaited_text(x) for q, x in records.items() if x.get("awaited") and q != r}
            return Verdict(r, None, ins, j, rec["step"], waiting,
                           f"rank {r} (stage {rec['stage']}) passed instruction {j} {ins} of step {rec['step']} without "
                           f"posting it: its peer's receives (matched in posting order) never get that transfer")
    holds, links = blocked(records, plans, min_wait_s)
    if not holds and links:
        return _lost_transfer(links[0], records, plans, [links[0][1]])
    if not holds:
        return Verdict(None, text="no rank is held up by another: no hang in these records")
    end, cycle = chain_ends(holds)
    if cycle:
        return Verdict(None, waiting={w: _awaited_text(records[w]) for w in holds},
                       text=f"a cycle of waits {' -> '.join(map(str, cycle))}: each rank waits for the next, which "
                            f"waits in turn; the ranks broke the plan's global order")
    roots: dict[int, list[tuple[int, Position]]] = {}  # culprit -> (waiter, position awaited) of its direct waiters
    by_peer: dict[int, dict[int, list[Position]]] = {}  # id of a holder list -> peer -> positions
    for w, h in holds.items():
        if id(h) not in by_peer:
            by_peer[id(h)] = {}
            for q, at in h:
                by_peer[id(h)].setdefault(q, []).append(at)
        roots.setdefault(end[w], []).extend((w, at) for at in by_peer[id(h)].get(end[w], ()))
    culprit = min(roots, key=lambda q: (-len({w for w, _ in roots[q]}), q))
    lost = [(q, r, at) for q, r, at in links if r == culprit]
    if lost:  # the rank everyone waits for waits itself for a transfer its peer did post
        return _lost_transfer(lost[0], records, plans, [culprit, *holds])
    step, j = min(at for _, at in roots[culprit])
    ins = _shown(plans.instr(culprit, j), [records[w]["awaited"] for w, _ in roots[culprit]])
    waiting = {w: _awaited_text(records[w]) for w in records if w in holds}
    stage = ranks.coords(culprit)[0]
    began = min(records[w]["written"] - records[w]["waited_s"] for w in holds)  # the first of these waits
    if culprit not in records:
        how = "gave no record (stopped or dead)"
    elif records[culprit]["written"] < began:
        rec = records[culprit]
        how = (f"has not answered since before the others began to wait (its last record: step {rec['step']}, "
               f"instruction {rec['index']} {rec['instr']}): stopped or dead")
    else:
        rec = records[culprit]
        how = f"is at instruction {rec['index']} {rec['instr']}" + (
            f", itself waiting for {_awaited_text(rec)}" if rec.get("awaited") else ", not waiting on anyone")
    return Verdict(culprit, None, ins, j, step, waiting,
                   f"rank {culprit} (stage {stage}) never did instruction {j} {ins} of step {step}: it {how}; "
                   f"{len(waiting)} rank(s) wait because of it")


# --- the report -----------------------------------------------------------------------------------
def table(records: dict[int, Record], ranks: Ranks, now: float | None = None) -> str:
    """One line a rank: stage, the instruction it is at, what it waits for and from whom, how long."""
    now = time.time() if now is None else now
    rows = [("rank", "stage", "step", "instruction", "state", "waits for", "for")]
    for r in range(ranks.world):
        rec = records.get(r)
        if rec is None:
            rows.append((str(r), str(ranks.coords(r)[0]), "?", "?", "no record", "", ""))
            continue
        at = f"{rec['index']} {rec['instr']}" if rec["index"] >= 0 else rec["instr"]
        since = rec["written"] - rec["waited_s"] if rec.get("awaited") else None
        took = f"{rec['waited_s']:.1f}s" if since is not None else ""
        rows.append((str(r), str(rec["stage"]), str(rec["step"]), at, rec["state"], _awaited_text(rec), took))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


AGAIN = "remove it and reproduce the hang to write fresh ones"


def check_positions(records: dict[int, Record], prog: Program, ranks: Ranks) -> None:
    """RecordError for a record whose stage or instruction no rank of this plan has: an index past
    the program was read as past every instruction of the step, and changed the verdict."""
    plans = Programs(prog, ranks)
    for r, rec in records.items():
        stage, name = plans.coords(r)[0], record_path("", r).name
        if rec["stage"] != stage:
            raise RecordError(f'{name}\'s "stage" {rec["stage"]} is not rank {r}\'s ({stage}) in this plan\'s layout: '
                              f"{AGAIN}")
        n = len(prog.ranks[stage * ranks.dp])  # a stage's ranks play one program (Programs)
        for key in ("index", "unposted"):
            if rec.get(key, -1) >= n:
                raise RecordError(f'{name}\'s "{key}" {rec[key]} is past the {n} instructions of rank '
                                  f"{r}'s program: {AGAIN}")


def report(out: str | Path, summary: dict[str, Any] | None = None) -> str | None:
    """The doctor's table and verdict from the records under run folder `out`; None without any.
    RecordError names a file under RUN/doctor that is not a rank's record."""
    run = read_run(out)
    if run is None:
        return None
    records, facts = run.records, run.plan
    ranks, prog = Ranks.of(facts), programs(facts)
    check_positions(records, prog, ranks)
    v = verdict(records, prog, ranks)
    lines = [f"hang doctor: {len(records)} of {ranks.world} ranks answered ({Path(out) / FOLDER})",
             table(records, ranks), f"verdict: {v.text}"]
    lines += [f"  rank {w} waits for {what}" for w, what in sorted(v.waiting.items())]
    if summary is not None and summary.get("straggler"):
        s = summary["straggler"]
        lines.append(f"straggler (summary.json): rank {s['rank']} made the others wait {s['s_per_step']:.3f}s a step"
                     + BASIS.get(s.get("compared_with"), ""))
    return "\n".join(lines)


# --- stragglers -----------------------------------------------------------------------------------
# The share of a layer's training cost (models' `layer_costs`: forward and backward together) each
# compute action does: forward, input gradient and weight gradient 2 FLOPs a weight each (F:B:W =
# 1:1:1, as the simulator's default).
SHARE = {Kind.F: 1 / 3, Kind.B: 1 / 3, Kind.W: 1 / 3, Kind.BW: 2 / 3}
# What the doctor's straggler line adds, by summary.json's `compared_with`.
BASIS = {"data-parallel replicas": ": its own work ran that much past its data-parallel replicas'",
         "planned work": ": its own work ran that much past the others', weighed by the plan's cost of each rank's"}


def planned_work(program: Sequence[Instr], chunk_costs: Sequence[float]) -> float:
    """The plan's cost of one step of a rank's compute, in the units of `chunk_costs` (each
    chunk's summed layer costs): what its instructions F, B, W and BW ask of it. Ranks of one stage
    run the same program: equal figures; across stages, what the partition's cost model expects."""
    return sum(SHARE[ins.kind] * chunk_costs[ins.action.chunk] for ins in program if isinstance(ins, Compute))


def stragglers(work: list[dict[str, Any]], ranks: Ranks) -> dict[str, Any]:
    """Which rank made the others wait most, per step, from each rank's own work: the seconds of
    its compute instructions less the waits inside them (`own_s` over `steps`, runtime/flight.py),
    beside the plan's cost of one step of that work (`planned`, `planned_work`).

    Waits alone cannot say it: a rank fed late by a slow peer is late in turn to its own sends and
    collectives, so the delay spreads over the slow rank's neighbours, which then wait as little
    as it does (with rank 1 slowed, blame by waits gave ranks 1, 2 and 3 0.31, 0.34 and 0.32 s a
    step, and named rank 2). Own work can: the ranks of one stage run the same program, so the
    data-parallel replicas of a stage say how long its work takes, and a rank whose own work
    runs past theirs holds its replicas up at every collective and its pipeline peers at every
    transfer by that much. With one replica (D = 1) each rank is compared with the others through
    the plan's cost of their work. The reference is the lower median of a pool's seconds per unit
    of planned work: up to half of a pool may be slow and still be told apart; with two, the faster."""
    if ranks.world < 2:
        return {}
    own = [w["own_s"] / max(1, w["steps"]) for w in work]
    planned = [w.get("planned") or 0.0 for w in work]
    if min(planned) <= 0:  # no cost model for this model: every rank's work taken as equal
        planned = [1.0] * ranks.world
    if ranks.dp > 1:
        pools = [[ranks.rank(p * ranks.dp + d) for d in range(ranks.dp)] for p in range(ranks.pp)]
        basis = "data-parallel replicas"
    else:
        pools, basis = [list(range(ranks.world))], "planned work"
    expected = [0.0] * ranks.world
    for pool in pools:
        rates = sorted(own[m] / planned[m] for m in pool)
        typical = rates[(len(rates) - 1) // 2]
        for m in pool:
            expected[m] = typical * planned[m]
    late = [max(0.0, o - e) for o, e in zip(own, expected)]
    worst = max(range(ranks.world), key=lambda r: (late[r], -r))
    return {"rank": worst, "stage": ranks.coords(worst)[0], "s_per_step": late[worst], "by_rank": late,
            "own_work_s": own, "compared_with": basis}
