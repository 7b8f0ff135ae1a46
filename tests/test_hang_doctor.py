"""The hang doctor: its verdict over synthetic records (fast lane), the flight record and watchdog in
one process, and injected faults at P=2 D=2 (distributed; the full matrix with PIPEZERO_HANG_MATRIX=1)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from one_line import DEEP, assert_one_line, run_main
from pipezero.doctor import Programs, Ranks, planned_work, programs, report, stragglers, table, verdict
from pipezero.flight_files import load_records, read_run
from pipezero.runtime.flight import FlightRecord
from pipezero.schedules.model_shapes import ModelShapes
from pipezero.schedules.program import PointToPoint

FACTS = {"schedule": "1f1b", "pp": 2, "dp": 2, "microbatches": 4, "virtual_stages": 1, "zero": 0,
         "grad_reduce": "step", "bucket_mb": 25.0, "zero3_keep_gathered": None, "recompute": False,
         "placement": "dp-inner", "model": ModelShapes.of_counts([[64], [64]]).to_json()}
PROG, RANKS = programs(FACTS), Ranks.of(FACTS)
EVERY = [Programs(PROG, RANKS).of(r) for r in range(RANKS.world)]  # each rank's program, peers its own


def at(rank: int, text: str) -> int:
    """Index of the instruction printed as `text` in `rank`'s program."""
    return [str(i) for i in EVERY[rank]].index(text)


def rec(rank: int, index: int, awaited: dict | None = None, step: int = 2, **extra) -> dict:
    return {"rank": rank, "stage": RANKS.coords(rank)[0], "state": "stalled", "step": step, "written": 100.0,
            "index": index, "instr": str(EVERY[rank][index]) if index >= 0 else "end of run", "nbytes": 0,
            "awaited": awaited, "waited_s": 2.0 if awaited else 0.0, "unposted": -1, "plan": FACTS, "run": "r",
            **extra}


def optim(rank: int) -> int:
    return at(rank, "OPTIM_STEP")


def stalled_pipeline() -> dict[int, dict]:
    """Rank 1 stopped before sending activation 1:1 to rank 3: rank 3 waits for it in 1F1, the
    others in their data-parallel gradient all-reduce."""
    return {0: rec(0, optim(0), {"op": "REDUCE_GRAD", "chunk": 0, "bucket": 0}),
            2: rec(2, optim(2), {"op": "REDUCE_GRAD", "chunk": 1, "bucket": 0}),
            3: rec(3, at(3, "1F1"), {"op": "RECV", "peer": 1, "transfer": [1, False, 1]})}


def test_a_rank_that_gave_no_record_is_named_with_the_send_it_never_made():
    v = verdict(stalled_pipeline(), PROG, RANKS)
    assert v.culprit == 1 and v.instruction == "SEND(act 1:1 to 3)" and v.index == at(1, "SEND(act 1:1 to 3)")
    assert v.step == 2 and sorted(v.waiting) == [0, 2, 3] and "no record" in v.text


def test_a_rank_stuck_in_its_own_work_is_named_not_its_waiting_peers():
    records = stalled_pipeline()
    records[1] = rec(1, at(1, "0F1"))  # alive, in a forward that never ends, waiting on no one
    v = verdict(records, PROG, RANKS)
    assert v.culprit == 1 and v.instruction == "SEND(act 1:1 to 3)" and "not waiting on anyone" in v.text
    records[1].update(step=1, written=90.0)  # its last record predates the waits: it stopped answering
    v = verdict(records, PROG, RANKS)
    assert v.culprit == 1 and v.step == 2 and "stopped or dead" in v.text and "step 1" in v.text


def test_a_send_passed_without_posting_is_named_before_its_consequences():
    j = at(1, "SEND(act 1:1 to 3)")
    records = stalled_pipeline()
    records[1] = rec(1, at(1, "0BW3"), {"op": "RECV", "peer": 3, "transfer": [0, True, 3]}, unposted=j)
    records[3] = rec(3, at(3, "1BW3"), {"op": "RECV", "peer": 1, "transfer": [1, False, 3]})  # a cycle follows
    v = verdict(records, PROG, RANKS)
    assert (v.culprit, v.index, v.instruction) == (1, j, "SEND(act 1:1 to 3)") and "without posting" in v.text


def test_a_transfer_posted_and_never_received_blames_the_link():
    records = stalled_pipeline()
    records[1] = rec(1, at(1, "0BW1"), {"op": "RECV", "peer": 3, "transfer": [0, True, 1]})  # past its SEND 1:1
    v = verdict(records, PROG, RANKS)
    assert v.culprit is None and v.link == (1, 3) and v.instruction == "SEND(act 1:1 to 3)"


def test_waits_in_a_cycle_are_a_broken_plan_order():
    records = {1: rec(1, at(1, "0BW0"), {"op": "RECV", "peer": 3, "transfer": [0, True, 0]}),
               3: rec(3, at(3, "1F0"), {"op": "RECV", "peer": 1, "transfer": [1, False, 0]})}
    records[1]["index"] = at(1, "SEND(act 1:0 to 3)") - 1  # never posted its send of 1:0
    assert "cycle" in verdict(records, PROG, RANKS).text


def test_finished_records_are_no_hang_and_the_table_shows_missing_ranks():
    records = {r: rec(r, -1, state="finished", step=3) for r in (0, 2, 3)}
    v = verdict(records, PROG, RANKS)
    assert v.culprit is None and v.link is None and "no hang" in v.text
    lines = table(stalled_pipeline(), RANKS, now=100.0).splitlines()
    assert len(lines) == 5 and "no record" in lines[2] and "activation 1:1 from rank 1" in lines[4]


def test_a_reduction_started_inside_a_backward_is_the_peers_same_backward():
    """The program places a fused backward's reductions inside it (at the moment autograd completes
    each bucket): a rank waiting there waits for its peer to reach that backward."""
    zero3 = programs({**FACTS, "zero": 3})
    j = [str(i) for i in zero3.ranks[0]].index("0BW3")
    assert [str(d) for d in zero3.ranks[0][j].during] == ["REDUCE_GRAD(0.0, wait)@grads 0"]
    records = {0: rec(0, j, {"op": "REDUCE_GRAD", "chunk": 0, "bucket": 0})}
    v = verdict(records, zero3, RANKS)
    assert v.culprit == 1 and v.instruction == "0BW3 (REDUCE_GRAD(0.0, wait)@grads 0)" and v.index == j and v.step == 2


def test_a_sublayer_record_compiles_the_runs_parts():
    """A record of --zero3-unit sublayer carries it: the doctor's program has the run's buckets (a
    block's attention and MLP apart), not a bucket a layer, so the bucket a rank waits on names the
    same tensors; an old record (no unit) is whole layers; a unit no run writes is refused."""
    from pipezero.config import ModelConfig
    from pipezero.models.presets import decoder_shapes

    model = decoder_shapes(ModelConfig(preset="tiny", n_layers=2, dim=32, n_heads=2, vocab_size=64), [(0, 4)])
    one = {**FACTS, "pp": 1, "zero": 3, "microbatches": 2, "model": model.to_json()}
    parts, whole = programs({**one, "zero3_unit": "sublayer"}), programs(one)
    assert parts.buckets.sublayer and not whole.buckets.sublayer
    assert len(parts.buckets.numels[0]) == len(whole.buckets.numels[0]) + 2
    f = next(str(i) for i in parts.ranks[0] if str(i).startswith("0F0"))
    assert "@fwd 1.1" in next(i for i in parts.ranks[0] if str(i) == f).describe()
    with pytest.raises(ValueError, match="zero3_unit 'half': one of layer, sublayer only"):
        programs({**one, "zero3_unit": "half"})


def test_placement_maps_global_ranks_to_program_slots():
    pp_inner = Ranks(2, 2, "pp-inner")  # rank = replica * P + stage
    assert [pp_inner.coords(r) for r in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert all(pp_inner.rank(pp_inner.slot(r)) == r for r in range(4))
    assert all(isinstance(i, PointToPoint) is False or i.peer in range(4) for r in EVERY for i in r)


def work(own: list[float], planned: list[float], steps: int = 2) -> list[dict]:
    """Each rank's `work` figures as summary.json gathers them, from seconds a step."""
    return [{"own_s": o * steps, "steps": steps, "planned": p} for o, p in zip(own, planned)]


def test_the_straggler_is_the_slow_rank_not_the_neighbour_that_waited_least():
    """Figures of a real run (1F1B, rank 1 slowed): the waits spread rank 1's delay over its
    neighbours (ranks 2 and 3 waited as little as rank 1), the old reading of them named rank 2;
    each rank's own work names rank 1, by what its replica, rank 0, took for the same program."""
    s = stragglers(work([0.028, 0.357, 0.024, 0.027], [4.13e6, 4.13e6, 4.52e6, 4.52e6]), RANKS)
    assert (s["rank"], s["stage"], s["compared_with"]) == (1, 0, "data-parallel replicas")
    assert s["s_per_step"] == pytest.approx(0.357 - 0.028) and s["by_rank"][1] == s["s_per_step"]
    assert s["by_rank"][0] == 0.0 and s["by_rank"][2] == 0.0 and s["by_rank"][3] == pytest.approx(0.003)
    assert s["own_work_s"] == pytest.approx([0.028, 0.357, 0.024, 0.027])
    # A stage with more work than another is no straggler: its replicas agree (stage 1 here).
    s = stragglers(work([0.02, 0.05, 0.30, 0.31], [1.0, 1.0, 9.0, 9.0]), RANKS)
    assert s["rank"] == 1 and s["s_per_step"] == pytest.approx(0.03)
    assert stragglers(work([0.5], [1.0]), Ranks(1, 1)) == {}


def test_without_replicas_the_plan_says_what_each_rank_should_take():
    """D = 1: stage 1 (the head) has twice stage 0's planned work and takes twice its seconds:
    no straggler there; stage 0 taking as long as stage 1 is the slow one, though stage 1's own
    work is no smaller and stage 1 waited least."""
    pipe = Ranks(2, 1)
    s = stragglers(work([0.4, 0.4], [1.0, 2.0]), pipe)
    assert (s["rank"], s["compared_with"]) == (0, "planned work") and s["s_per_step"] == pytest.approx(0.2)
    s = stragglers(work([0.2, 0.4], [1.0, 2.0]), pipe)
    assert s["s_per_step"] == pytest.approx(0.0) and s["by_rank"] == pytest.approx([0.0, 0.0])
    # No cost model (planned 0): every rank's work is taken as equal; the one that took longest.
    assert stragglers(work([0.2, 0.5, 0.3], [0.0, 0.0, 0.0]), Ranks(3, 1))["rank"] == 1


def test_half_of_a_stage_may_be_slow_and_the_slowest_rank_is_named():
    """D = 4: the reference is the lower median of the replicas, so two slow ranks of a stage are
    both seen, and the slower one anywhere is named."""
    ranks = Ranks(2, 4)
    own = [0.10, 0.16, 0.10, 0.19, 0.20, 0.21, 0.20, 0.20]  # ranks 1 and 3 of stage 0 slow
    s = stragglers(work(own, [1.0] * 4 + [2.0] * 4), ranks)
    assert (s["rank"], s["stage"]) == (3, 0) and s["s_per_step"] == pytest.approx(0.09)
    assert s["by_rank"][1] == pytest.approx(0.06) and max(s["by_rank"][4:]) == pytest.approx(0.01)


def test_planned_work_weighs_each_compute_action_by_its_chunk():
    assert [planned_work(EVERY[r], [3.0, 6.0]) for r in range(4)] == pytest.approx([12.0, 12.0, 24.0, 24.0])
    # zb-v: a rank of stage 0 holds chunks 0 and 3, of stage 1 chunks 1 and 2; F, B and W are a
    # third each of a micro-batch's chunk cost, 4 micro-batches
    zbv = programs({**FACTS, "schedule": "zb-v", "virtual_stages": 2,
                    "model": ModelShapes.of_counts([[64]] * 4).to_json()})
    costs = [1.0, 2.0, 4.0, 8.0]
    assert [planned_work(Programs(zbv, RANKS).of(r), costs) for r in range(4)] == pytest.approx([36.0, 36.0, 24.0, 24.0])


class FakeClock:
    """The flight record's clock, moved by the test: the accounting is under test, not the machine's
    sleeps (beside other work on 2 cores a 0.05 s sleep took 0.176 s)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_own_work_is_compute_less_the_waits_inside_it_after_the_first_step(monkeypatch):
    import pipezero.runtime.flight as flight

    clock = FakeClock()
    monkeypatch.setattr(flight, "time", clock)

    class Clock:
        step = 1

    f = FlightRecord(1, 0, step_of=Clock())
    compute, send = EVERY[1][at(1, "0F0")], EVERY[1][at(1, "SEND(act 1:0 to 3)")]
    for step in (1, 2, 3):
        Clock.step = step
        f.begin(0, compute)
        with f.awaiting("activation", op="RECV", peer=3, transfer=[0, True, 0]):
            clock.sleep(0.03)  # blocked: not its own work
        clock.sleep(0.01 * step)  # its own work
        f.begin(1, send)
        clock.sleep(0.02)  # a send is no compute
        f.outside("after OPTIM_STEP")
    w = f.work()
    # steps 2 and 3: 0.02 + 0.03 s; the waits (0.06 s more) or the sends (0.04 s more) counted would differ
    assert w["steps"] == 2 and w["own_s"] == pytest.approx(0.05), w
    assert f.first_work_s == pytest.approx(0.01) and f.waits()["p2p"]["3"] == pytest.approx(0.09)


def test_the_flight_record_keeps_a_fixed_ring_and_notices_an_unposted_send():
    f = FlightRecord(1, 0, keep=4)
    prog = EVERY[1]
    for step in (1, 2):
        for i, ins in enumerate(prog):
            f.begin(i, ins)
            if isinstance(ins, PointToPoint) and ins.send and not (step == 2 and str(ins) == "SEND(act 1:1 to 3)"):
                f.posted(ins.peer, 1024)
        f.outside("after OPTIM_STEP")
    assert len(f.recent()) == 4 and f.recent()[-1][1] == len(prog) - 1  # the newest four, in order
    assert f.unposted == at(1, "SEND(act 1:1 to 3)") and f.sent == {3: 3}
    with pytest.raises(RuntimeError), f.awaiting("x", op="RECV", peer=3, transfer=[0, True, 0]):
        raise RuntimeError("peer gone")
    assert f.failure == "peer gone" and f.awaited is None and 3 in f.waited_on


def test_the_watchdog_writes_a_stalled_wait_asks_the_others_and_says_when_it_resumed(tmp_path):
    from pipezero.runtime.watch import Watch, asked

    f = FlightRecord(3, 1)
    w = Watch(f, tmp_path, stall_s=0.05, plan=FACTS, run="r")  # not started: the test ticks it
    with f.awaiting("activation", op="RECV", peer=1, transfer=[1, False, 1]):
        w.check()
        assert not load_records(tmp_path)  # not yet past the threshold
        time.sleep(0.06)
        w.check()
        assert load_records(tmp_path)[3]["state"] == "stalled" and asked(tmp_path) > 0
    w.check()
    assert load_records(tmp_path)[3]["state"] == "resumed"
    w.stop() if w._thread.is_alive() else None
    assert "rank 1 (stage 0) never did" not in (report(tmp_path) or "")  # a straggler is no culprit



def test_sigusr1_rings_the_watchdog_and_ends_no_rank(tmp_path):
    """SIGUSR1, the doctor's "where is everyone", must reach a rank's watchdog thread (the main thread
    may be blocked in a wait, where Python runs no handler) and never end the rank, however the rank
    was started (alone, srun, an outside torchrun): by default it ended the process, exit 138."""
    import signal

    from pipezero.runtime.watch import Watch, asked

    before = signal.getsignal(signal.SIGUSR1)
    w = Watch(FlightRecord(0, 1), tmp_path, stall_s=60, plan=FACTS, run="r")  # not started: the test ticks it
    w.bell.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)  # the default action would end this test's process here
        w.check()
        assert asked(tmp_path) > 0 and load_records(tmp_path)[0]["state"] == "asked"
    finally:
        w.bell.remove()
    assert signal.getsignal(signal.SIGUSR1) == before and signal.set_wakeup_fd(-1) == -1



def test_sigusr1_before_the_watchdog_runs_is_one_line(capsys):
    """Asked while a rank still starts (imports, the corpus, the process group): a line, not exit 138."""
    import signal

    from pipezero.runtime.watch import early_requests

    before = signal.getsignal(signal.SIGUSR1)
    with early_requests():
        os.kill(os.getpid(), signal.SIGUSR1)
    assert "while this process trains no step (starting up or finishing)" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGUSR1) == before


def test_sigusr1_to_the_cluster_process_asks_every_rank(tmp_path):
    """`pipezero cluster` starts its ranks in other namespaces: SIGUSR1 to it asks them (node 0's rank
    0 prints the report), where by default it ended the process and skipped its teardown."""
    import signal

    from pipezero.runtime.watch import asked, relaying_requests

    before = signal.getsignal(signal.SIGUSR1)
    with relaying_requests(tmp_path):
        os.kill(os.getpid(), signal.SIGUSR1)
    assert asked(tmp_path) > 0 and signal.getsignal(signal.SIGUSR1) == before

@pytest.mark.distributed
def test_a_lone_process_answers_sigusr1_and_trains_on(text_dir, tmp_path):
    """One process without --nproc (as each srun task or outside torchrun worker is) gets SIGUSR1: it
    writes its record, prints the report, and trains on."""
    import signal
    import subprocess
    import sys

    out = tmp_path / "run"
    metrics = out / "metrics.jsonl"

    def steps() -> int:
        return len(metrics.read_text().splitlines()) if metrics.is_file() else 0

    proc = subprocess.Popen([sys.executable, "-m", "pipezero.cli", "train", "--preset", "tiny", "--data",
                             str(text_dir), "--tokenizer", "bytes", "--seq-len", "32", "--microbatches", "1",
                             "--micro-batch-size", "1", "--max-steps", "100000", "--sample-tokens", "0",
                             "--eval-every", "0", "--no-progress", "--no-save-final", "--out", str(out)],
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not steps():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGUSR1)
        while not load_records(out) or steps() < load_records(out)[0]["step"] + 2:  # answered, then trained on
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
            time.sleep(0.1)
    finally:
        proc.kill()
    assert load_records(out)[0]["state"] == "asked"
    assert "hang doctor: 1 of 1 ranks answered" in proc.stderr.read()

# --- injected faults, P=2 D=2 (tests/hang_faults.py) ------------------------------------------------
MATRIX = os.environ.get("PIPEZERO_HANG_MATRIX") == "1"  # every fault on every case (about 2 minutes here)
HANGS = [(f, c) for f in ("stop", "kill", "skip") for c in ("1f1b", "zb-v", "zero3")] if MATRIX else \
    [("stop", "1f1b"), ("kill", "zero3"), ("skip", "zb-v")]  # in CI: each fault once, each case once


def expected(fault: str, out: Path) -> tuple[int, str | tuple[str, ...], int]:
    """The rank, the instruction the doctor must name (or its possible starts) and the least index
    it may have, from what the fault wrote when it struck. A rank killed in the wait for a reduction
    may have completed that one and others behind it (gloo runs them on its own threads): the doctor
    must name one of its collectives at or after the one it died in, the first its peers never saw
    end (a later reduction, or the optimizer step's all-reduce)."""
    from hang_faults import FAULTY

    struck = json.loads((out / "fault.json").read_text())
    if fault == "kill":  # its program prints it as REDUCE_GRAD(c.k) or REDUCE_GRAD(c.k, wait): one a step
        facts = read_run(out).plan
        mine = Programs(programs(facts), Ranks.of(facts)).of(FAULTY)  # a fused backward holds its reductions

        def names(ins) -> list[str]:
            texts = map(str, [ins, *getattr(ins, "during", ())])
            return [t.split("@")[0].split(",")[0].rstrip(")") + ")" for t in texts]
        return FAULTY, ("REDUCE_GRAD(", "OPTIM_STEP"), next(j for j, ins in enumerate(mine)
                                                             if struck["op"] in names(ins))
    chunk, grad, mb = struck["transfer"]
    return FAULTY, f"SEND({'grad' if grad else 'act'} {chunk}:{mb} to {struck['peer']})", struck["index"]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.distributed
@pytest.mark.parametrize("fault,case", HANGS)
def test_the_doctor_names_the_rank_and_instruction_of_an_injected_hang(text_dir, tmp_path, fault, case, capsys):
    from hang_faults import FAULTY, faulty_run

    from pipezero.cli import main
    from ranks import run_ranks

    t0 = time.monotonic()
    seen = run_ranks(faulty_run, 4, str(text_dir), str(tmp_path), fault, case, timeout=90,
                     lost=(FAULTY,) if fault in ("stop", "kill") else ())
    took = time.monotonic() - t0
    assert all(s is None or s.startswith("PipelineTimeout") for s in seen), (seen, report(tmp_path))  # named
    rank, instruction, index = expected(fault, tmp_path)
    run = read_run(tmp_path)
    records, facts = run.records, run.plan
    v = verdict(records, programs(facts), Ranks.of(facts))
    named = instruction if isinstance(instruction, tuple) else (instruction,)  # possibly inside a compute instruction
    assert v.culprit == rank and any(x in v.instruction for x in named) and v.step == 2, (v, report(tmp_path))
    assert v.index == index if fault != "kill" else v.index >= index, (v, index)
    if fault == "skip":
        assert records[FAULTY]["state"] == "failed" and records[FAULTY]["step"] == 2
    else:  # a stopped or killed rank cannot answer: at most a record from before (a stall under load)
        assert FAULTY not in records or records[FAULTY]["state"] != "failed" and "stopped or dead" in v.text, v
    assert len(v.waiting) >= 2, v
    assert gone(json.loads((tmp_path / "fault.json").read_text())["pid"])  # nothing left running
    capsys.readouterr()
    assert main(["doctor", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert f"verdict: rank {rank} (stage 0)" in printed and v.instruction in printed, printed
    assert took < 60, took


@pytest.mark.distributed
@pytest.mark.alone  # a measured time against the plan: no other test's ranks beside it
def test_a_slow_rank_is_a_straggler_not_a_culprit(text_dir, tmp_path, capsys):
    """Rank 1's compute takes three times as long (and 0.3 s more a chunk a step); the run finishes,
    summary.json names it as the straggler (not its pipeline neighbour, rank 3, which the slowness
    makes late in turn), and the doctor finds no hang in the stall records."""
    from hang_faults import FAULTY, faulty_run, slow_cases

    from pipezero.cli import main
    from ranks import run_ranks

    cases = ["1f1b", "zb-v", "zero3"] if MATRIX else ["zero3"]
    seen = run_ranks(slow_cases, 4, str(text_dir), str(tmp_path), cases, timeout=120)
    assert all(s == ["trained"] * len(cases) for s in seen), seen
    for case in cases:
        out = tmp_path / case
        s = json.loads((out / "summary.json").read_text())["straggler"]
        # Named by a margin: 0.3 s a step or more and twice its compute injected; no other rank near it
        # (own work is wall time: on a loaded machine a rank waiting for a core seems slower, 0.09 s
        # seen, and so does the slow one, three times as much).
        others = [x for r, x in enumerate(s["by_rank"]) if r != FAULTY]
        assert s["rank"] == FAULTY and s["compared_with"] == "data-parallel replicas", s
        assert s["s_per_step"] > 0.2 and max(others) < s["s_per_step"] / 2, s
        assert load_records(out), "the slow rank made a wait pass the stall threshold"
        capsys.readouterr()
        assert main(["doctor", str(out)]) == 0
        printed = capsys.readouterr().out
        assert "no hang" in printed and f"straggler (summary.json): rank {FAULTY}" in printed, printed


def test_waits_that_just_began_are_no_hang():
    """SIGUSR1 on a moving run: records taken moments apart show short waits, no culprit."""
    records = stalled_pipeline()
    for r in records.values():
        r.update(state="asked", waited_s=0.01)
    assert verdict(records, PROG, RANKS).culprit is None
    records[3]["state"] = "failed"  # a failed wait counts however short (a peer gone)
    assert verdict(records, PROG, RANKS).culprit == 1


# (what is under RUN, the status, what stderr says): files by a record's name that no rank wrote are
# named as such (not "no flight records", exit 1, as if none had been written), and a record or
# summary.json of the wrong shape is one line
DOCTOR_CASES = [
    ("deep", 2, "rank-00000.json under"),  # past json's recursion limit
    ("pipe", 2, "are not flight records as pipezero writes them"),  # read without waiting for a writer
    ("shapes", 2, "rank-00000.json, rank-00001.json, rank-00002.json under"),  # [] / rank "x" / {}
    ("minimal", 2, 'rank-00000.json misses "step"'),
    ("straggler", 2, "(KeyError: 's_per_step')"),
]


@pytest.mark.parametrize("case, code, needle", DOCTOR_CASES)
def test_doctor_reads_records_as_data(case, code, needle, tmp_path, capsys):
    records = tmp_path / "doctor"
    records.mkdir()
    if case == "deep":
        (records / "rank-00000.json").write_text(DEEP)
        (tmp_path / "summary.json").write_text(DEEP)
    elif case == "pipe":
        os.mkfifo(records / "rank-00000.json")
    elif case == "shapes":
        (records / "rank-00000.json").write_text("[]")
        (records / "rank-00001.json").write_text('{"rank": "x", "written": 1}')
        (records / "rank-00002.json").write_text("{}")
        (tmp_path / "summary.json").write_text("[1]")
    elif case == "minimal":
        (records / "rank-00000.json").write_text('{"rank": 0, "written": 1}')
    else:
        (tmp_path / "summary.json").write_text('{"straggler": {"rank": 1}}')
    got, err = run_main(["doctor", str(tmp_path)], capsys)
    assert got == code and "Traceback" not in err and len(err.strip().splitlines()) == 1 and needle in err, err


def test_doctor_of_a_folder_that_is_not_there_or_a_file_is_one_line(tmp_path, capsys):
    """A run folder that is not there is no run without records: the fix is another path, not a
    search for records."""
    (tmp_path / "f").write_text("x")
    assert_one_line(*run_main(["doctor", str(tmp_path / "nowhere")], capsys), "nowhere does not exist: pass the run's")
    assert_one_line(*run_main(["doctor", str(tmp_path / "f")], capsys), "f is not a folder: pass the run's folder")
    run = tmp_path / "run"  # a file where the records' folder belongs: "no flight records", exit 1
    run.mkdir()
    (run / "doctor").write_text("x")
    assert_one_line(*run_main(["doctor", str(run)], capsys), f"{run / 'doctor'} is a file, where a run keeps its "
                                                             f"flight records")


@pytest.mark.parametrize("sizes, needle", [
    ({"pp": 1_000_000_000}, "past what train runs"),  # lowering would never end
    ({"microbatches": 1_000_000_000}, "past what train runs"),
    ({"dp": 0}, "positive integers only"),
    ({"pp": "2"}, "positive integers only"),
    ({"zero": 9}, "zero 9: a ZeRO stage, 0 to 3 only"),  # was "KeyError: 9"
])
def test_doctor_bounds_the_layout_a_record_claims(sizes, needle, tmp_path, capsys):
    import json

    plan = {"schedule": "1f1b", "pp": 2, "microbatches": 4, "virtual_stages": 1, "dp": 1, "zero": 0,
            "grad_reduce": "step", "bucket_mb": 25.0, "zero3_keep_gathered": None, "recompute": False,
            "model": {"tied": None, "chunks": [{"splits": c > 0, "stop": c + 1, "layers": []} for c in range(2)]}, **sizes}
    record = {"rank": 0, "written": 1.0, "run": "x", "step": 1, "index": 0, "instr": "F", "state": "waiting",
              "stage": 0, "waited_s": 1.0, "plan": plan}
    (tmp_path / "doctor").mkdir()
    (tmp_path / "doctor" / "rank-00000.json").write_text(json.dumps(record))
    assert_one_line(*run_main(["doctor", str(tmp_path)], capsys), needle)


def test_doctor_does_not_wait_on_a_pipe_named_summary_json(tmp_path, capsys):
    """`doctor RUN` where RUN/summary.json is a named pipe: opened to read, it would wait for a writer."""
    import os

    from pipezero.cli.doctor import cmd_doctor

    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "summary.json")
    assert cmd_doctor(type("Args", (), {"run": str(run)})()) == 1  # no records: the usual answer, at once
    assert "no flight records" in capsys.readouterr().err


@pytest.mark.parametrize("text", [b"\x00\xff binary", b"[1, 2]", b'{"rank": "0", "written": 1}'])
def test_a_damaged_flight_record_is_named_not_taken_for_none(text, tmp_path, capsys):
    """`doctor RUN` over rank-*.json files that are garbage, binary or of the wrong types names them:
    "no flight records" (exit 1) would say no rank had written one."""
    from pipezero.doctor import FOLDER

    (tmp_path / FOLDER).mkdir()
    (tmp_path / FOLDER / "rank-00000.json").write_bytes(text)
    assert_one_line(*run_main(["doctor", str(tmp_path)], capsys),
                    "rank-00000.json under " + str(tmp_path / FOLDER) + " are not flight records as pipezero writes")


def test_an_empty_record_folder_is_still_no_records(tmp_path, capsys):
    from pipezero.doctor import FOLDER

    (tmp_path / FOLDER).mkdir()
    code, err = run_main(["doctor", str(tmp_path)], capsys)
    assert code == 1 and "no flight records under" in err


def test_a_wide_layout_compiles_one_replica_and_maps_its_peers(tmp_path):
    """Ranks of a stage play one program but for the peers their transfers name: the doctor lowers
    one replica's programs (P of them, not P x D: at 256 x 256 that took minutes) and reads every
    rank's from them, a far replica's peers included."""
    wide = {**FACTS, "pp": 4, "dp": 16384, "microbatches": 8, "zero": 3,
            "model": ModelShapes.of_counts([[64]] * 4).to_json()}
    prog, ranks = programs(wide), Ranks.of(wide)
    assert sum(1 for r in prog.ranks if r) == 4
    d = 12345  # stage 0 of replica d never sent its activation 1:0; stage 1 of d waits for it
    waiter, culprit = ranks.rank(1 * ranks.dp + d), ranks.rank(d)
    records = {waiter: {**rec(0, 0), "rank": waiter, "stage": 1, "index": 3, "instr": "1F0", "plan": wide,
                        "awaited": {"op": "RECV", "peer": culprit, "transfer": [1, False, 0]}, "waited_s": 2.0}}
    for q in (ranks.rank(e) for e in (0, 7, ranks.dp - 1)):  # other replicas' stage 0, at work
        records[q] = {**records[waiter], "rank": q, "stage": 0, "awaited": None, "waited_s": 0.0}
    v = verdict(records, prog, ranks)
    assert v.culprit == culprit and v.instruction == f"SEND(act 1:0 to {waiter})" and v.step == 2, v.text
    folder = tmp_path / "doctor"
    folder.mkdir()
    for r, x in records.items():
        (folder / f"rank-{r:05d}.json").write_text(json.dumps(x))
    assert f"rank {culprit} (stage 0) never did instruction" in report(tmp_path)


# --- records read as data on disk ------------------------------------------------------------------
def lay_records(run: Path, files: dict[str, bytes]) -> Path:
    """RUN/doctor/ holding rank 0's real record (a wait on rank 1) and `files` beside it."""
    folder = run / "doctor"
    folder.mkdir(parents=True)
    real = rec(0, optim(0), {"op": "REDUCE_GRAD", "chunk": 0, "bucket": 0})
    (folder / "rank-00000.json").write_text(json.dumps(real))
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


def deep_json() -> bytes:
    return b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize("files, needle", [
    ({"rank-00001.json": json.dumps({**rec(1, 0), "rank": 0, "written": 200.0}).encode()},
     "rank-00001.json says it is rank 0"),  # it replaced rank 0's real record
    ({"rank-00001.json": b'{"rank": 1, "written'}, "rank-00001.json is not JSON"),
    ({"rank-00001.json": deep_json()}, "rank-00001.json is nested deeper than"),
    ({"rank-00001.json": b"[]"}, "rank-00001.json holds no record"),
    ({"rank-00001.json": json.dumps({**rec(1, 0), "step": "2"}).encode()}, 'rank-00001.json\'s "step" is'),
    ({"rank-0000x.json": json.dumps(rec(1, 0)).encode()}, "rank-0000x.json is not named for a rank"),
    ({"rank-00001.json": json.dumps(rec(1, 0, {"op": "RECV", "peer": [3], "transfer": [0, 0, 0]})).encode()},
     'rank-00001.json\'s "awaited" RECV wants a whole-number "peer"'),
    ({"rank-99999.json": json.dumps({**rec(1, 0), "rank": 99999}).encode()}, "rank-99999.json names rank 99999"),
    # positions no rank reaches: an index past its program was taken as past every instruction, and
    # one below -1 (outside the program) turned the verdict to "no hang"
    ({"rank-00001.json": json.dumps({**rec(1, 0), "index": 10**9}).encode()},
     'rank-00001.json\'s "index" 1000000000 is past the'),
    ({"rank-00001.json": json.dumps({**rec(1, 0), "index": -5}).encode()}, 'rank-00001.json\'s "index" is -5'),
    ({"rank-00001.json": json.dumps({**rec(1, 0), "step": -1}).encode()}, 'rank-00001.json\'s "step" is -1'),
    ({"rank-00001.json": json.dumps({**rec(1, 0), "stage": 1}).encode()}, 'rank-00001.json\'s "stage" 1 is not'),
])
def test_a_record_the_doctor_cannot_trust_is_named_with_why(files, needle, tmp_path, capsys):
    from one_line import assert_one_line, run_main

    lay_records(tmp_path, files)
    assert_one_line(*run_main(["doctor", str(tmp_path)], capsys), needle)


def test_the_doctor_follows_no_link_and_caps_what_it_reads(tmp_path, capsys):
    from one_line import assert_one_line, run_main

    folder = lay_records(tmp_path / "run", {})
    (folder / "rank-00001.json").symlink_to("/etc/passwd")
    assert_one_line(*run_main(["doctor", str(tmp_path / "run")], capsys), "rank-00001.json is a link")
    (folder / "rank-00001.json").unlink()
    with open(folder / "rank-00001.json", "wb") as f:
        f.truncate(1 << 40)  # sparse: a terabyte that takes no disk
    assert_one_line(*run_main(["doctor", str(tmp_path / "run")], capsys),
                    "rank-00001.json is 1 TiB, past the 64 MiB a record may be")
    elsewhere = lay_records(tmp_path / "other", {}).parent
    (folder / "rank-00001.json").unlink()
    (tmp_path / "run" / "doctor").rename(tmp_path / "moved")
    (tmp_path / "run" / "doctor").symlink_to(elsewhere / "doctor")
    assert_one_line(*run_main(["doctor", str(tmp_path / "run")], capsys), "doctor is a link out of the run folder")


def test_records_carry_no_plan_the_run_writes_it_once(tmp_path):
    """Every rank of a 65,536-rank run writes a record: the plan (the model's shapes, tens of KB)
    once for the run, not in each, keeps reading them all a matter of seconds."""
    from pipezero.runtime.watch import Watch

    for rank in (1, 3):
        f = FlightRecord(rank, RANKS.coords(rank)[0])
        Watch(f, tmp_path, stall_s=0.05, plan=FACTS, run="r").write("asked")
    assert not any("plan" in json.loads(p.read_text()) for p in (tmp_path / "doctor").glob("rank-*.json"))
    assert sorted(p.name for p in (tmp_path / "doctor").glob("plan-*.json")) == ["plan-r.json"]
    assert "2 of 4 ranks answered" in report(tmp_path)


def test_a_request_that_is_not_a_plain_file_asks_nothing(tmp_path):
    """The launcher and every rank's watchdog read RUN/doctor/request each tick: a pipe there would
    block them for ever, a link would be followed out of the run folder."""
    from pipezero.runtime.watch import ask, asked

    (tmp_path / "doctor").mkdir()
    os.mkfifo(tmp_path / "doctor" / "request")
    assert asked(tmp_path) == 0.0  # at once: no writer is waited for
    (tmp_path / "doctor" / "request").unlink()
    (tmp_path / "elsewhere").write_text("12345.0\n")
    (tmp_path / "doctor" / "request").symlink_to(tmp_path / "elsewhere")
    assert asked(tmp_path) == 0.0
    (tmp_path / "doctor" / "request").unlink()
    assert asked(tmp_path) == 0.0 and ask(tmp_path) == asked(tmp_path) > 0
