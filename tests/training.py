"""Shared by the distributed training tests: a tiny model config and the one-process comparison."""

from __future__ import annotations

from typing import Any

import torch

from pipezero.config import DType, Placement
from pipezero.config import ScheduleKind as K
from pipezero.schedules.registry import check_layout, default_virtual
from pipezero.settings import build_config
from pipezero.verify import TOLERANCES, RankResult, compare_params, compare_steps, failure, with_tied_head

V_OF = {kind: default_virtual(kind) for kind in K}  # the fewest chunks a rank each schedule takes
# Three optimizer steps a run: the first two at warm-up rates, the third at the peak, so a step reads
# the Adam moments, the accumulated gradients and the buckets the step before it left, twice, and
# each comparison holds losses of two updated models and the parameters after three updates. More
# steps repeat the same step at 0.2 CPU-seconds a case on 4 ranks (the layout tests' main cost).
STEPS = 3
# The comparisons' learning rate. Adam turns rounding in near-zero early gradients into steps of
# the full rate, so the float floor of "same model" grows with it: two one-process runs of the
# tests' tiny model that differ only in how the batch is cut into micro-batches (summation order)
# end 5 steps apart by 8.4e-6 of a parameter at lr 1e-2 (8e-5 tied), 3.1e-6 at 3e-3, 1.4e-6 at 1e-3
# (this machine, AVX2). At 1e-2 the cases run there reached 0.79 of the 1e-5 tolerance (ZeRO dp=2)
# and moved between 0.41 and 0.79 with the CPU kernels chosen (ATEN_CPU_CAPABILITY): the likely
# reason the GPU machine's CPU failed ZeRO-0 dp=2 once. At 1e-3 the whole suite's worst is 0.21. A
# bug still moves parameters by ~lr a step.
LR = 1e-3


def layouts(pp: int, dp: int) -> list[dict]:
    """Every schedule with M in {P, 2P, 3P+1} where the schedule allows it. V-Half at M = 2P only:
    its runtime paths (the V placement, split backward) are ZB-V's, trained at every M here, and the
    checker proves its order for every M; one layout a run shows that order trains, at less cost."""
    cases = []
    for kind in K:
        for m in (2 * pp,) if kind is K.V_HALF else (pp, 2 * pp, 3 * pp + 1):
            try:
                check_layout(kind, pp, m, V_OF.get(kind, 1))
            except ValueError:
                continue
            cases.append({"pp": pp, "dp": dp, "kind": kind, "m": m})
    return cases


def peer_layouts(pp: int, dp: int) -> list[dict]:
    """Layouts torch.distributed.pipelining runs that Megatron-style rules refuse: ZB-V with fewer
    than 2P micro-batches (torch: (P, M) = (2, 2), (4, 3), (4, 4)) and interleaved 1F1B with M not a
    multiple of P (one round of P+1, or of 3P/2 when that is whole). `layouts` has ZB-V at M = P."""
    cases = [{"pp": pp, "dp": dp, "kind": K.ZB_V, "m": m} for m in (pp - 1, pp + 1)]
    cases += [{"pp": pp, "dp": dp, "kind": K.INTERLEAVED_1F1B, "m": m} for m in sorted({pp + 1, 3 * pp // 2})
              if m % pp]
    return cases


def tiny_overrides(data: str, out: str, pp: int, dp: int, kind: K, m: int, **extra: Any) -> dict:
    base = {
        "model.preset": "tiny", "model.n_layers": 6, "model.dim": 64, "model.n_heads": 4, "model.vocab_size": 256,
        "data.path": data, "data.tokenizer": "bytes", "data.seq_len": 32,
        "parallel.pp": pp, "parallel.dp": dp, "parallel.schedule": kind.value, "parallel.microbatches": m,
        "parallel.micro_batch_size": 2, "parallel.virtual_stages": V_OF.get(kind, 1) if pp > 1 else 1,
        "parallel.timeout_s": 60.0, "parallel.bucket_mb": 0.05,  # several buckets even for a tiny model
        "run.max_steps": STEPS, "run.out": out, "run.progress": False, "run.sample_tokens": 0, "run.eval_every": 0,
        "run.save_final": False,
        "run.eval_batches": 1, "optim.warmup_steps": 2, "optim.lr": LR,
    }
    base.update(extra)
    return base


def train_cases(rank: int, world: int, data: str, out: str, cases: list[dict]) -> list[dict]:
    """Train each case (keyword arguments of tiny_overrides) in this process group, in order. Every
    run is also held to its program: what each step played of ZeRO's collectives is what the
    compiled program says (`record_departure`), and leaves no process group or thread of its own
    behind (`left_behind`), so every layout test checks that too."""
    hold_every_run()  # a run that departs from its program raises from `train`, naming its case's folder
    from pipezero.engine import train

    seen = watch_program()
    results = []
    for i, case in enumerate(cases):
        cfg = build_config(None, tiny_overrides(data, f"{out}/case{i}", **case))
        seen.clear()
        before = run_resources()
        res = train(cfg, snapshot=True)
        if problem := left_behind(before, run_resources()):
            raise AssertionError(f"rank {rank}, {case}: {problem}")
        started = seen.get("started", [])
        results.append({"case": case, "losses": res.losses, "grad_norms": res.grad_norms, "params": res.params,
                        "peak_live": res.peak_live, "peak_gathered": res.peak_gathered_training, "started": started,
                        "waited": [p.name for p in last_step(seen) if p.event.value == "wait"],
                        # the last evaluation's and text sample's records, as "start LOSS_SUM"
                        "forward_only": {what: [f"{p.event.value} {p.name}" for p in record]
                                         for what, record, _, _ in seen.get("records", []) if what != "step"},
                        "bounds": seen["stage"].bounds})
    return results


def hold_every_run() -> None:
    """From now on in this rank process, every `pipezero.engine.train` that returns is held to its
    program (`record_departure`) and fails with the first departure: a test that trains through
    `train` or the command line (both call it), `train_cases` among them, is checked once a run."""
    import pipezero.engine as engine

    if getattr(engine.train, "held", False):
        return
    train = engine.train

    def held(cfg, *args, **kwargs):
        seen = watch_program()
        seen.clear()
        res = train(cfg, *args, **kwargs)
        if problem := record_departure(seen):
            raise AssertionError(f"the run in {cfg.run.out} departed from its program: {problem}")
        return res

    held.held = True  # type: ignore[attr-defined]
    engine.train = held


def run_resources() -> tuple[int, list[str]]:
    """What a run may leave alive in this rank process: its process groups (torch's registry) and
    the threads running now, by name."""
    import threading

    from torch.distributed import distributed_c10d

    return len(distributed_c10d._world.pg_map), sorted(t.name for t in threading.enumerate())


def left_behind(before: tuple[int, list[str]], after: tuple[int, list[str]]) -> str:
    """What a finished run left alive ("" where nothing): a gloo group's transport thread wakes
    every 10 ms while the group lives, so a rank that trains case after case would keep every
    earlier case's groups polling."""
    groups = after[0] - before[0]
    threads = sorted(set(after[1]) - set(before[1]))
    if groups or threads:
        return f"the run left {groups} process groups and the threads {threads} behind"
    return ""


def watch_program() -> dict:
    """From now on in this rank process, every run leaves in the returned dict its stage, the
    collectives its last step started (zero/coordinator.py `issued`) and the record (`played`) of
    every step (and whether it was applied), evaluation and text sample, each copied when the
    executor has played its program."""
    import pipezero.engine as engine
    from pipezero.runtime.executor import Executor
    from pipezero.zero.coordinator import outside_since

    if not hasattr(engine, "_watched"):
        build, run, seen = engine.build_stage, Executor.run, {}

        def keep_stage(*args, **kwargs):
            seen["stage"] = stage = build(*args, **kwargs)
            return stage

        def keep_started(self, *args, **kwargs):
            stats = run(self, *args, **kwargs)
            comm = seen["stage"].zero.comm
            seen["started"] = list(comm.issued)
            seen.setdefault("records", []).append(("step", list(comm.played), seen["stage"].program,
                                                   stats.outcome.applied))
            return stats

        def forward_only(what: str, play):
            def keep_played(self, program, *args, **kwargs):
                comm = seen["stage"].zero.comm
                before = outside_since(comm.played)  # with the outside readers' waits just before it
                out = play(self, program, *args, **kwargs)
                seen.setdefault("records", []).append((what, list(comm.played[before:]), tuple(program), True))
                return out
            return keep_played

        Executor.evaluate = forward_only("evaluation", Executor.evaluate)
        Executor.sample = forward_only("sample", Executor.sample)
        engine.build_stage, Executor.run, engine._watched = keep_stage, keep_started, seen
    return engine._watched


def last_step(seen: dict) -> list:
    """The record of the last step `watch_program` saw (empty where none)."""
    steps = [record for what, record, _, _ in seen.get("records", []) if what == "step"]
    return steps[-1] if steps else []


def record_departure(seen: dict) -> str:
    """Where the run `watch_program` saw last played other than its program says, on any step or
    held-out evaluation or text sample (their own forward-only programs), "" where nowhere: every start of a
    collective (name, its format on the wire and the bytes the program prices, group), every wait for
    a reduction or a gather (at the instruction that waits) and every release, in order
    (schedules/played.py `expected` and `departure`)."""
    from pipezero.schedules.played import departure, expected

    stage = seen.get("stage")
    if stage is None:
        return ""
    carried: frozenset[str] = frozenset()
    counts = {"step": 0, "evaluation": 0, "sample": 0}
    records = seen.get("records", [])
    last_step = max((n for n, r in enumerate(records) if r[0] == "step"), default=-1)
    for n, (what, record, program, applied) in enumerate(records):
        counts[what] += 1
        where = f"{what} {counts[what]}"
        want = expected(program, stage.plan.buckets, applied)
        # who may wait outside the programs just before this one: a checkpoint or the memory profile
        # after a step, the end of the run only once the steps are over (a snapshot's gathers and a
        # trial's end come after every record)
        readers = ("checkpoint", "memory profile", *(("end of run",) if n > last_step else ()))
        problem, carried = departure([(p.event.value, p.name, p.place, p.idle) for p in record], want, carried,
                                     readers)
        if problem:
            return f"{where}: {problem}; played {[(p.event.value, p.name) for p in record]}"
        own = [p for p in record if not p.place.startswith("outside")]  # outside readers': the step before's
        if own and any(p.step != own[0].step for p in own):
            return f"{where}: events recorded under other steps"
        starts = [e for e in want if e.event == "start"]
        for p, e in zip((p for p in record if p.event.value == "start"), starts):
            if e.wire and (p.wire, p.nbytes) != (e.wire, e.nbytes):
                return f"{where}: {p.name} moved {p.nbytes} bytes of {p.wire}, the program {e.nbytes} of {e.wire}"
            if p.group != e.group:
                return f"{where}: {p.name} in group {p.group}, the program's is {e.group}"
    return ""


def assert_played(cases: list[dict], results: list[dict]) -> None:
    """The program comparison of `train_cases` had something to compare, on rank 0 (`results`: its
    results, case by case): its last step started reductions and waited for each, gathers at ZeRO-1-3
    with D > 1 (each waited for at ZeRO-3), the tied embedding's sum in every tied pipeline (rank 0
    holds the embedding), an offloaded step copied and stepped every bucket on the host, the held-out
    evaluation ended in the world's LOSS_SUM, and a text sample at ZeRO-3 gathered (every rank takes
    part, kept gathered or layer by layer)."""
    for c, r in zip(cases, results):
        started, waited = r["started"], r["waited"]
        assert r["forward_only"]["evaluation"][-1:] == ["start LOSS_SUM"], c
        if c.get("run.sample_tokens") and c.get("parallel.zero") == 3 and c["dp"] > 1:
            assert any(e.startswith("start UNSHARD") for e in r["forward_only"]["sample"]), c
        assert any(s.startswith("REDUCE_GRAD") for s in started), c
        assert sorted(w for w in waited if w.startswith("REDUCE_GRAD")) == \
            sorted(s for s in started if s.startswith("REDUCE_GRAD")), c
        if c.get("parallel.zero") and c["dp"] > 1:
            assert any(s.startswith("UNSHARD") for s in started), c
            if c["parallel.zero"] == 3:
                assert any(w.startswith("UNSHARD") for w in waited), c
        if c.get("model.tie_embeddings") and c["pp"] > 1:
            assert any(s.startswith("TIED_SUM") for s in started), c
        if c.get("parallel.offload") == "optimizer":
            copied = sorted(s[len("OFFLOAD_GRAD"):] for s in started if s.startswith("OFFLOAD_GRAD"))
            assert copied and copied == sorted(s[len("HOST_STEP"):] for s in started if s.startswith("HOST_STEP")), c


def train_cases_watching_gathers(rank: int, world: int, data: str, out: str, cases: list[dict]) -> list[dict]:
    """train_cases, also reporting the most ZeRO-3 parameter bytes left gathered right after any
    backward action (B, W or BW) of any step: layer by layer, that must be nothing."""
    from pipezero.zero.sharded import ZeroDP

    most = {"bytes": 0}
    for name in ("after_input_grad", "after_backward"):
        clean = getattr(ZeroDP, name)

        def watched(self, chunk, *args, _clean=clean):
            _clean(self, chunk, *args)
            if self.sharded is not None:
                most["bytes"] = max(most["bytes"], self.sharded.gathered_bytes())
        setattr(ZeroDP, name, watched)
    results = []
    for case in cases:
        most["bytes"] = 0
        (res,) = train_cases(rank, world, data, f"{out}/{len(results)}", [case])
        results.append({**res, "gathered_after_backward": most["bytes"]})
    return results


def reference(data: str, out: str, global_mb: int, **model: Any) -> tuple[list[float], dict[str, torch.Tensor],
                                                                         list[float]]:
    """Losses, parameters and gradient norms of one process."""
    from pipezero.engine import train

    cfg = build_config(None, tiny_overrides(data, out, 1, 1, K.ONE_F_ONE_B, global_mb, **model))
    res = train(cfg, snapshot=True)
    return res.losses, res.params, res.grad_norms


def rank_results(per_rank: list[dict]) -> list[RankResult]:
    """One case's results, rank by rank, as `pipezero verify` sees its ranks."""
    from pipezero.parallel.mesh import Mesh

    case = per_rank[0]["case"]
    placement = Placement(case.get("parallel.placement", Placement.DP_INNER.value))
    return [RankResult(rank, (m := Mesh(case["pp"], case["dp"], rank, placement)).pp_rank, m.dp_rank, r["losses"],
                       r["grad_norms"], r["params"]) for rank, r in enumerate(per_rank)]


def reference_key(data: str, case: dict) -> tuple:
    """What makes a case's one-process run: its data, global batch (in micro-batches), its model,
    optimizer and data settings and its steps (the layout's are not: every layout trains the same run)."""
    model = {k: v for k, v in case.items() if k.startswith(("model.", "optim.", "data.")) or k == "run.max_steps"}
    return data, case["m"] * case["dp"], tuple(sorted(model.items()))


# The one-process runs of this test session, shared by every layout test: one (data, global batch,
# model and optimizer settings) is one run whatever test asks for it. They were the parent's serial
# work after every rank had finished, again in each test.
ONE_PROCESS_RUNS: dict = {}


def assert_same_training(results: list[list[dict]], data: str, tmp_path, refs: dict | None = None) -> None:
    """`results[rank][case]`: on every rank, every case's losses, gradient norms and parameters equal
    the one-process run's; each data-parallel replica of each stage is compared on its own (one
    merged copy would hide a replica that drifted). `refs` caches the one-process runs (default: the
    session's)."""
    refs = ONE_PROCESS_RUNS if refs is None else refs
    for per_rank in zip(*results):
        case = per_rank[0]["case"]
        key = reference_key(data, case)
        if key not in refs:
            refs[key] = reference(data, str(tmp_path / f"ref{len(refs)}"), key[1], **dict(key[2]))
        ref_losses, ref_params, ref_norms = refs[key]
        layout = build_config(None, tiny_overrides(data, str(tmp_path / "unused"), **case))
        ref_params = with_tied_head(ref_params, layout)  # both ends of a tied embedding compared
        ranks = rank_results(list(per_rank))
        tol = TOLERANCES[DType.FP32]
        checks, problems = compare_params(ranks, ref_params, tol.params)
        checks += compare_steps(ranks, ref_losses, ref_norms, tol)
        bad = problems + [failure(c, ranks) for c in checks if not c.ok]
        assert not bad, f"{case}: " + "; ".join(bad)
