"""`train --layout auto`: the planner chooses the layout from the world size, the memory limit and
this machine's costs; every rank trains the same choice; the run checks the prediction."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from one_line import assert_one_line, run_main
from pipezero.planner.auto import choose_layout, cluster_for
from pipezero.planner.auto_check import LayoutCheck, compare
from pipezero.planner.auto_job import Request, decide, provisional, request, settings_of
from pipezero.probe import LinkCost, Probe
from pipezero.settings import build_config


def tiny_request(world: int, limit_gib: float = 4.0, costs: Probe | None = None, **settings: str) -> Request:
    given = {"model.preset": "tiny", "data.seq_len": "64", **settings}
    req = request(None, given, {}, None, None, None, ranks=(world, world))
    req.limit_gib, req.cuda, req.costs = limit_gib, False, costs
    return req


def fake_probe(tflops: float, gbps: float, overhead_s: float = 1e-4) -> Probe:
    return Probe("cpu", "fp32", 4, 64, {"F": 0.01, "B": 0.01, "W": 0.01}, tflops, overhead_s,
                 links={"node": LinkCost(1e-4, gbps)}, host_copy_gbps=5.0, host_adamw_params_s=1e8)


def test_the_choice_is_the_planners_fastest_that_fits_and_follows_the_costs():
    slow_link = provisional(tiny_request(2, costs=fake_probe(tflops=1.0, gbps=0.001)))
    fast_link = provisional(tiny_request(2, costs=fake_probe(tflops=0.001, gbps=100.0)))
    for choice in (slow_link, fast_link):
        steps = [r["predicted_step_s"] for r in choice.ranked]
        assert len(choice.ranked) == 4 and steps == sorted(steps)  # the chosen one and three runners-up
        assert choice.ranked[0]["flags"].startswith("--pp ") and choice.fitting >= 4
        shapes = {tuple(r["settings"][f"parallel.{k}"] for k in ("pp", "dp", "schedule", "virtual_stages",
                                                                  "microbatches", "micro_batch_size"))
                  for r in choice.ranked}
        assert len(shapes) == 4  # runners-up are alternatives, not the choice with another ZeRO stage
    # a slow link makes D = 2's gradient traffic dearer than P = 2's bubble; with a fast one, the other way
    assert slow_link.chosen["flags"].startswith("--pp 2 --dp 1"), slow_link.chosen["flags"]
    assert fast_link.chosen["flags"].startswith("--pp 1 --dp 2"), fast_link.chosen["flags"]
    # the same inputs give the same choice: ranks reading one --costs file agree without a word
    again = provisional(tiny_request(2, costs=fake_probe(tflops=1.0, gbps=0.001)))
    assert again.ranked == slow_link.ranked


def test_layout_flags_given_with_auto_are_constraints_the_choice_keeps():
    choice = provisional(tiny_request(4, **{"parallel.zero": "2", "parallel.pp": "2"}))
    for r in choice.ranked:
        assert r["settings"]["parallel.zero"] == "2" and r["settings"]["parallel.pp"] == "2", r["flags"]
    cfg = build_config(None, settings_of(tiny_request(4, **{"parallel.zero": "2", "parallel.pp": "2"}), choice))
    assert (cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.zero) == (2, 2, 2)
    assert cfg.global_batch == 16  # the settings' M x B x D, whatever M and B the choice took


def test_the_chosen_layouts_flags_reproduce_it():
    choice = provisional(tiny_request(4))
    flags = choice.chosen["flags"].split()
    from pipezero.cli.command_line import build_parser
    from pipezero.cli.flags import flag_values

    args = build_parser().parse_args(["train", "--preset", "tiny", "--seq-len", "64", *flags])
    cfg = build_config(None, flag_values(args)[0])
    chosen = build_config(None, settings_of(tiny_request(4), choice))
    assert cfg.parallel == chosen.parallel


def test_a_world_size_no_layout_fits_is_refused_in_one_line_with_the_memory_that_would(capsys):
    with pytest.raises(Exception) as e:
        provisional(tiny_request(2, limit_gib=0.001))
    line = str(e.value)
    assert "no layout of 2 ranks fits 0.001 GiB a rank" in line and "give --host-memory" in line  # CPU ranks
    need = float(line.split("give --host-memory ")[1].split()[0]) / 2  # the node's, for its two ranks
    # that much memory is enough: the same request with it chooses a layout
    assert provisional(tiny_request(2, limit_gib=need)).fitting >= 1
    with pytest.raises(Exception, match="split into no layout"):
        provisional(tiny_request(3, **{"parallel.microbatches": "1", "parallel.micro_batch_size": "1",
                                       "parallel.dp": "1"}))


def test_train_refuses_bad_auto_requests_in_one_line_before_any_rank(capsys, tmp_path):
    base = ["train", "--preset", "tiny", "--layout", "auto", "--out", str(tmp_path / "run")]
    assert_one_line(*run_main([*base, "--gpu-memory", "0.001"], capsys), "--gpu-memory")
    assert_one_line(*run_main([*base, "--stage-layers", "2,2"], capsys), "--stage-layers")
    assert_one_line(*run_main([*base, "--nproc", "2", "--pp", "3"], capsys),
                    "no layout of 2 ranks has pp = 3 (global batch 16): it weighs --pp 1, 2 here; drop --pp")
    # a value the search never tries is said as such: "no layout has" alone read as if none could
    assert_one_line(*run_main([*base, "--nproc", "2", "--micro-batch-size", "16"], capsys),
                    "no layout of 2 ranks has micro_batch_size = 16 (global batch 64): it weighs --micro-batch-size "
                    "1, 2, 4, 8 here; drop --micro-batch-size, or give the layout yourself (without --layout auto)")
    # pipezero cluster's nodes x ranks a node are the world the choice weighs, checked before any node starts
    assert_one_line(*run_main(["cluster", "--nodes", "2", "--ranks-per-node", "2", "train", "--preset", "tiny",
                               "--layout", "auto", "--pp", "3"], capsys), "no layout of 4 ranks has pp = 3")
    assert_one_line(*run_main(["train", "--preset", "tiny", "--global-batch", "8"], capsys),
                    "--global-batch is read only with --layout auto")
    assert_one_line(*run_main([*base, "--global-batch", "0"], capsys), "--global-batch 0")
    assert_one_line(*run_main(["train", "--preset", "tiny", "--layout-trials", "2"], capsys),
                    "--layout-trials is read only with --layout auto")
    assert_one_line(*run_main([*base, "--layout-trials", "-1"], capsys), "--layout-trials -1: expected")
    bad = tmp_path / "bad.json"
    bad.write_text('{"device": "cpu"}')
    assert_one_line(*run_main([*base, "--costs", str(bad)], capsys), "not a probe pipezero wrote")
    # a busy machine's absurd rate is refused here as plan --costs refuses it (one reader of a probe)
    absurd = tmp_path / "absurd.json"
    absurd.write_text(json.dumps(fake_probe(754974.72, 1.0).to_json()))
    assert_one_line(*run_main([*base, "--costs", str(absurd)], capsys), "tflops 754974.72 is outside what --tflops")
    nolink = tmp_path / "nolink.json"
    nolink.write_text(json.dumps(fake_probe(1.0, float("nan")).to_json()))
    assert_one_line(*run_main([*base, "--costs", str(nolink)], capsys), "links.node.gbps nan is outside")
    assert_one_line(*run_main(["verify", "--preset", "tiny", "--layout", "auto"], capsys), "run train --layout auto")
    assert not (tmp_path / "run").exists()


def test_quantized_traffic_is_chosen_only_where_the_user_allowed_it():
    plain = provisional(tiny_request(4, costs=fake_probe(1.0, 0.001)))
    assert all(r["quantize_grads_bits"] == 0 and r["quantize_weights_bits"] == 0 for r in plain.ranked)
    allowed = provisional(tiny_request(4, costs=fake_probe(1.0, 0.001), **{"parallel.quantize_grads": "int8"}))
    assert any(r["quantize_grads_bits"] == 8 for r in allowed.ranked)
    assert all("--quantize-grads int8" in r["flags"] for r in allowed.ranked if r["quantize_grads_bits"])


def test_a_lone_process_probes_and_chooses_without_a_process_group(monkeypatch):
    import pipezero.probe as probes

    # tiny's block beside a loaded suite is refused (its fixed cost takes it all, tests/test_probe.py
    # times a larger one): the block's timing is faked, the rest of the probe runs as it is
    block = {"F": 0.01, "B": 0.01, "W": 0.01}
    monkeypatch.setattr(probes, "probe_block", lambda cfg, device, budget_s: (block, 1.0, 1e-4))
    req = tiny_request(1)
    first = provisional(req)
    cfg = build_config(None, settings_of(req, first))
    choice, took = decide(req, first, cfg)
    # it probed (its repetitions bounded by PROBE_BUDGET_S a figure: tests/test_probe.py holds the budget)
    assert took is not None and took >= choice.costs["probe_s"] > 0
    assert choice.chosen["settings"]["parallel.pp"] == "1" and choice.costs["tflops"] != first.costs["tflops"]


def test_the_prediction_check_names_the_term_that_differs():
    chosen = {"predicted_step_s": 1.0, "predicted_peak_gib": 2.0, "predicted_compute_s": 0.8,
              "predicted_idle_s": 0.2, "bubble": 0.2, "flags": "--pp 2"}
    figures, warning = compare(chosen, 1.1, 0.2, 2.1)
    assert warning is None and figures["measured_step_s"] == 1.1
    _, warning = compare(chosen, 2.0, 0.6, None)  # 0.8 s compute, 1.2 s waiting: the waiting is off
    assert warning is not None and "+100%" in warning and "most in bubble and exposed communication" in warning
    _, warning = compare(chosen, 1.0, 0.2, 3.0)
    assert warning is not None and "peak memory 3 GiB measured" in warning and "step time" not in warning
    check = LayoutCheck({"ranked": [chosen], "fitting": 1, "weighed": 1, "skipped": 0, "seconds": 0.1, "costs": {}})
    said = [check.observe({"step_time_s": t, "bubble": 0.2}, i == 0, i == 6) for i, t in enumerate([9, 1, 1, 1, 1, 1])]
    assert said == [None] * 6  # the first step (9 s) is left out; five steps as predicted
    entry, _ = check.summary(None)
    assert entry["measured_step_s"] == 1 and entry["steps_measured"] == 5 and entry["warning"] is None
    json.dumps(entry)


def test_cluster_from_a_probe_reads_its_rates_and_links():
    cfg = build_config(None, {"model.preset": "tiny"})
    cluster = cluster_for(cfg, 4, 4, 2.0, False, fake_probe(0.5, 3.0, 2e-3))
    assert (cluster.tflops, cluster.mfu, cluster.overhead_s, cluster.intra_gbps) == (0.5, 1.0, 2e-3, 3.0)
    assert cluster.gpus == 4 and cluster.cpu and cluster.wire_bytes == 4
    assert choose_layout(cfg, cluster, 16, {}).ranked
    assert choose_layout(cfg, cluster, 16, {"parallel.pp": 2}).chosen["flags"].startswith("--pp 2 --dp 2")


def test_ranks_sharing_one_hosts_cores_are_priced_sharing_them():
    """Where the probe found the job's ranks on fewer cores than ranks (the emulated cluster's nodes
    are one host), the planner prices compute shared by them: counting a node's cores once a node
    priced 4 ranks on 2 cores as if each had its own, and predicted a step 0.35 of what it measured."""
    cfg = build_config(None, {"model.preset": "tiny"})
    costs = fake_probe(0.05, 1.0)
    shared = cluster_for(cfg, 4, 2, 2.0, False, replace(costs, cores=2))
    own = cluster_for(cfg, 4, 2, 2.0, False, replace(costs, cores=64))
    assert shared.cores == 2 and own.cores == 0
    lay = "--pp 1 --dp 4 --zero 1 --schedule 1f1b --microbatches 1 --micro-batch-size 4"
    step = {c.cores: next(r["predicted_step_s"] for r in choose_layout(cfg, c, 16, {"parallel.pp": 1, "parallel.zero": 1,
                                                                             "parallel.microbatches": 1}).ranked
                          if r["flags"] == lay) for c in (shared, own)}
    assert step[2] > 1.5 * step[0], step


def choose_and_train(rank: int, world: int, data: str, out: str) -> dict:
    """A rank of a --layout auto job whose own probe would choose apart from rank 0's: rank 0's
    measures a fast link, the other's a slow one. It trains what it was sent for two steps."""
    import pipezero.probe as probes
    from pipezero.engine import train

    measured = probes.probe
    # the block's own timing is not under test, and on a loaded machine a tiny block's is refused
    # (its fixed cost takes it all): the rest of the probe runs as it is
    probes.probe_block = lambda cfg, device, budget_s: ({"F": 0.01, "B": 0.01, "W": 0.01}, 1.0, 1e-4)
    # nor is the cores' share: the real block timed with every rank at once, against that fixed one
    # alone, read a loaded machine's few cores as a fraction of one and turned the choice
    probes.block_together = lambda cfg, device, budget_s, timeout_s: 0.03

    def own_probe(cfg, device, budget_s=0.5, groups=None):
        found = measured(cfg, device, groups=groups, budget_s=0.02)
        found.tflops = 0.001 if rank == 0 else 1.0  # rank 0: compute-bound, so D = 2 wins; else P = 2
        return found

    probes.probe = own_probe  # the module decide() reads them from
    probes.probe_link = lambda group, device, budget_s: LinkCost(1e-4, 100.0 if rank == 0 else 0.001)
    settings = {"model.preset": "tiny", "data.seq_len": "32", "data.path": data, "data.tokenizer": "bytes",
                "run.max_steps": "2", "run.out": out, "run.progress": False, "run.sample_tokens": "0",
                "run.save_final": False, "parallel.timeout_s": "60"}
    req = request(None, settings, {}, None, None, None, ranks=(world, world))
    first = provisional(req)
    cfg = build_config(None, settings_of(req, first))
    choice, took = decide(req, first, cfg)
    mine = provisional(Request(**{**req.__dict__, "costs": fake_probe(0.001 if rank == 0 else 1.0,
                                                                      100.0 if rank == 0 else 0.001)}))
    result = train(build_config(None, settings_of(req, choice)), choice=choice.to_json())
    return {"chosen": choice.chosen["flags"], "own": mine.chosen["flags"], "losses": result.losses, "took": took}


@pytest.mark.distributed
def test_every_rank_trains_rank_0s_choice_and_the_summary_holds_its_prediction(text_dir, tmp_path):
    from ranks import run_ranks

    out = tmp_path / "run"
    ranks = run_ranks(choose_and_train, 2, str(text_dir), str(out))
    # alone, each rank would have chosen another layout: rank 0 data parallelism, rank 1 a pipeline
    assert ranks[0]["own"].startswith("--pp 1 --dp 2") and ranks[1]["own"].startswith("--pp 2 --dp 1"), ranks
    assert ranks[0]["chosen"] == ranks[1]["chosen"] and ranks[0]["chosen"].startswith("--pp 1 --dp 2"), ranks
    assert len(ranks[0]["losses"]) == 2
    entry = json.loads((out / "summary.json").read_text())["layout_choice"]
    assert entry["flags"] == ranks[0]["chosen"] and entry["steps_measured"] == 1
    assert entry["predicted_step_s"] > 0 and entry["measured_step_s"] > 0 and len(entry["runners_up"]) == 3


@pytest.mark.parametrize("flags, flag", [
    (["--zero3-prefetch", "2"], "--zero3-prefetch"),
    (["--zero3-unit", "sublayer"], "--zero3-unit"),
    (["--no-overlap-gather"], "--no-overlap-gather"),
    (["--nproc", "2", "--zero", "1", "--buckets-in-flight", "2"], "--buckets-in-flight"),  # dp left to the choice
])
def test_a_flag_only_some_layouts_read_needs_the_constraints_that_choose_them(capsys, tmp_path, flags, flag):
    """A flag read only at some ZeRO stage, replica count or pipeline depth, beside --layout auto
    without those constraints: refused against the provisional layout, naming a --zero the user
    never gave, or refused on every rank after the probe where the choice differs."""
    argv = ["train", "--preset", "tiny", "--layout", "auto", "--out", str(tmp_path / "run"), *flags]
    code, err = run_main(argv, capsys)
    assert_one_line(code, err, f"--layout auto with {flag}")
    assert not (tmp_path / "run").exists()


def test_with_compile_the_choice_is_only_of_layouts_compile_runs():
    """--compile runs no split-backward schedule and no --recompute (settings.py): a choice of one
    would be refused on every rank after the probe, where every rank has built its model."""
    from pipezero.schedules.registry import SPLIT_BACKWARD

    plain = provisional(tiny_request(2, costs=fake_probe(tflops=1.0, gbps=0.001)))
    assert any(r["settings"]["parallel.schedule"] in {k.value for k in SPLIT_BACKWARD} for r in plain.ranked)
    compiled = provisional(tiny_request(2, costs=fake_probe(tflops=1.0, gbps=0.001), **{"run.compile": True}))
    for r in compiled.ranked:
        assert r["settings"]["parallel.schedule"] not in {k.value for k in SPLIT_BACKWARD}, r["flags"]
        assert "--recompute" not in r["flags"], r["flags"]
    build_config(None, settings_of(tiny_request(2, **{"run.compile": True}), compiled))  # no refusal


def test_a_flag_only_some_layouts_read_is_taken_with_the_constraints_that_read_it():
    """--zero3-unit sublayer (or --zero3-prefetch) with --zero 3 --pp 1 --dp 2 given beside --layout
    auto: refused as "with --zero 0", checked against the trivial layout the request is built on."""
    for extra in ({"parallel.zero3_unit": "sublayer"}, {"parallel.zero3_prefetch": "2"}):
        given = {"parallel.zero": "3", "parallel.pp": "1", "parallel.dp": "2", **extra}
        req = tiny_request(2, **given)
        cfg = build_config(None, settings_of(req, provisional(req)))
        assert (cfg.parallel.zero, cfg.parallel.dp) == (3, 2)


@pytest.mark.parametrize("flags, needle", [
    (["--recompute"], "--recompute with --compile"),
    (["--nproc", "2", "--schedule", "zb-h1"], "--compile cannot run --schedule zb-h1"),
])
def test_a_constraint_compile_cannot_run_is_named_beside_auto(capsys, tmp_path, flags, needle):
    """Filtered out of the choice, the constraint left no layout, and the refusal blamed memory."""
    argv = ["train", "--preset", "tiny", "--layout", "auto", "--compile", "--out", str(tmp_path / "run"), *flags]
    assert_one_line(*run_main(argv, capsys), needle)


def test_costs_measured_where_the_run_does_not_train_are_refused(capsys, tmp_path):
    """A GPU's probe prices CPU ranks (or a bf16 probe an fp32 run) at rates they never reach: plan
    --costs refuses another device kind, and train --layout auto --costs took it without a word."""
    base = ["train", "--preset", "tiny", "--layout", "auto", "--device", "cpu", "--out", str(tmp_path / "run")]
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps({**fake_probe(1.0, 1.0).to_json(), "device": "NVIDIA H100 80GB HBM3"}))
    assert_one_line(*run_main([*base, "--costs", str(gpu)], capsys), "was measured on NVIDIA H100 80GB HBM3")
    half = tmp_path / "bf16.json"
    half.write_text(json.dumps({**fake_probe(1.0, 1.0).to_json(), "dtype": "bf16"}))
    assert_one_line(*run_main([*base, "--costs", str(half)], capsys), "was measured in bf16")
    assert not (tmp_path / "run").exists()


def test_costs_timed_at_another_sequence_length_are_said_once(capsys, tmp_path):
    """A probe of 64-token blocks prices a 128-token run's compute at a rate measured at another
    shape: said in one warning line before the choice (not refused: its figures still rank layouts)."""
    probe = tmp_path / "costs.json"
    probe.write_text(json.dumps(fake_probe(1.0, 1.0).to_json()))  # 64 tokens
    base = ["train", "--preset", "tiny", "--layout", "auto", "--device", "cpu", "--costs", str(probe),
            "--host-memory", "0.001", "--out", str(tmp_path / "run")]  # refused after the choice: nothing trains
    code, err = run_main([*base, "--seq-len", "128"], capsys)
    warned = [line for line in err.splitlines() if "timed blocks of 64 tokens" in line]
    assert code == 2 and len(warned) == 1 and "probe with --seq-len 128" in warned[0], err
    code, err = run_main([*base, "--seq-len", "64"], capsys)
    assert code == 2 and "timed blocks" not in err, err


def test_a_global_batch_past_trains_token_limit_is_named_not_blamed_on_the_world_size(capsys, tmp_path):
    argv = ["train", "--preset", "tiny", "--layout", "auto", "--out", str(tmp_path / "run"),
            "--global-batch", "100000000000"]
    code, err = run_main(argv, capsys)
    assert_one_line(code, err, "--global-batch 100000000000 x --seq-len")
    assert "tokens a step" in err and "split into no layout" not in err


def test_on_cpu_ranks_the_memory_refusal_names_the_hosts_memory(capsys, tmp_path):
    """CPU ranks' limit is the host's memory a rank: the refusal advised --gpu-memory, which CPU runs
    do not read for it."""
    argv = ["train", "--preset", "tiny", "--layout", "auto", "--device", "cpu", "--host-memory", "0.001",
            "--out", str(tmp_path / "run")]
    code, err = run_main(argv, capsys)
    assert_one_line(code, err, "give --host-memory")
    assert "--gpu-memory" not in err


def test_a_probe_that_cannot_measure_inside_the_job_is_one_line(capsys, tmp_path, monkeypatch):
    """A busy machine's probe (its block no slower than an action's fixed cost) raised ProbeError
    through the job: a traceback on rank 0, and the other ranks waited out --timeout for its choice."""
    import pipezero.probe as probes

    def busy(*args, **kwargs):
        raise probes.ProbeError("the block's F, B and W took 1 ms, no more than three of an action's fixed cost")

    monkeypatch.setattr(probes, "probe", busy)
    argv = ["train", "--preset", "tiny", "--layout", "auto", "--device", "cpu", "--out", str(tmp_path / "run")]
    code, err = run_main(argv, capsys)
    assert code == 1 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pipezero: error: --layout auto") and "fixed cost" in lines[0], err
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


@pytest.mark.parametrize("flags, needle", [
    (["--quantize-grads", "int8"], "--layout auto with --quantize-grads int8: no layout of 1 rank"),
    (["--nproc", "2", "--pp", "2", "--quantize-grads", "int8"], "no layout of 2 ranks with --pp 2"),
    (["--nproc", "2", "--zero", "0", "--quantize-weights", "int8"], "no layout of 2 ranks with --zero 0"),
])
def test_quantized_traffic_no_candidate_has_is_refused_as_unread(capsys, tmp_path, flags, needle):
    """At one rank (or a constraint leaving D = 1, or ZeRO-0 for weights) no layout weighed has the
    traffic the flag allows: it was accepted and read by nothing, where a given layout refuses it."""
    argv = ["train", "--preset", "tiny", "--layout", "auto", "--out", str(tmp_path / "run"), *flags]
    assert_one_line(*run_main(argv, capsys), needle)


def ranked_of(*steps: float) -> list[dict]:
    """A choice's ranked layouts as the model orders them, predicted `steps` seconds."""
    return [{"flags": f"--pp {i + 1}", "predicted_step_s": s, "settings": {}} for i, s in enumerate(steps)]


def test_trials_take_the_candidates_predicted_within_the_band_at_most_k():
    from pipezero.planner.trial_rounds import BAND, candidates

    assert BAND == 0.15  # the model's stated error (auto_check.TOLERANCE)
    ranked = ranked_of(1.0, 1.1, 1.15, 1.2)
    assert candidates(ranked, 3) == [0, 1, 2]
    assert candidates(ranked, 2) == [0, 1]
    assert candidates(ranked, 4) == [0, 1, 2]  # 1.2 s is past 15% of 1.0 s
    assert candidates(ranked, 0) == [] and candidates(ranked, 1) == []  # off, or only the chosen one
    assert candidates(ranked_of(1.0, 1.5, 1.6), 3) == []  # no near-tie: nothing to settle


def test_trials_stop_at_their_budget_and_a_run_too_short_for_two_tries_none():
    from pipezero.planner.trial_rounds import budget_holds_two, cut_line, room_for_another, skipped_line, trial_budget_s

    budget = trial_budget_s(100, 0.5)
    assert budget == pytest.approx(5.0)  # 10% of 100 steps of 0.5 s
    assert room_for_another(0.0, [], budget)  # the first (the chosen one's) always
    assert room_for_another(2.0, [2.0], budget) and not room_for_another(4.0, [2.0, 2.0], budget)
    assert not room_for_another(1.0, [1.0, 4.5], budget)  # the dearest trial so far stands for the next
    line = cut_line(2, 3, 4.0, budget, 100, 0.5)
    assert "\n" not in line and "after 2 of 3" in line and "5.0 s" in line and "--max-steps 100" in line
    # two trials of 3 steps at the predicted step fit 10% of 60 steps, not of 59: a shorter run tries none
    assert budget_holds_two(60) and not budget_holds_two(59)
    assert "a run of 60 steps or more tries them" in skipped_line(8, 0.397)


def test_the_fastest_trial_wins_and_ties_keep_the_models_order():
    from pipezero.planner.trial_rounds import Trial, winner

    def trials(*steps):
        return [Trial(f"--pp {i}", 1.0, s, None if s is not None else "rank 1: out of memory")
                for i, s in enumerate(steps)]

    assert winner(trials(0.36, 0.27, 0.30)) == 1
    assert winner(trials(0.300, 0.297)) == 0  # 1% faster: a tie, the model's choice stays
    assert winner(trials(0.300, 0.290)) == 1
    assert winner(trials(None, 0.5, 0.4)) == 2  # a failed trial is dropped
    assert winner(trials(None, None)) is None


def shaped(*rows: tuple[str, float]) -> list[dict]:
    """Ranked layouts "PP/DP/SCHEDULE/M", predicted the seconds given."""
    out = []
    for text, step in rows:
        pp, dp, kind, m = text.split("/")
        out.append({"flags": text, "predicted_step_s": step,
                    "settings": {"parallel.pp": pp, "parallel.dp": dp, "parallel.schedule": kind,
                                 "parallel.virtual_stages": "1", "parallel.microbatches": m}})
    return out


def test_trials_try_another_shape_before_a_sibling_that_differs_only_in_micro_batching():
    from pipezero.planner.trial_rounds import candidates

    ranked = shaped(("4/1/gpipe/4", 0.175), ("4/1/gpipe/8", 0.178), ("4/1/zb-h2/4", 0.1785), ("2/2/1f1b/4", 0.186))
    assert candidates(ranked, 3) == [0, 2, 3]  # the gpipe sibling waits for a free place
    assert candidates(ranked, 4) == [0, 1, 2, 3]
    assert candidates(ranked, 2) == [0, 2]
    siblings = shaped(("4/1/gpipe/4", 1.0), ("4/1/gpipe/8", 1.01), ("4/1/gpipe/16", 1.02), ("2/2/1f1b/4", 1.3))
    assert candidates(siblings, 3) == [0, 1, 2]  # no other shape near: the siblings are the near-ties


def test_a_runoff_round_takes_those_near_the_rounds_fastest_in_reverse_order():
    from pipezero.planner.trial_rounds import RUNOFF, runoff

    assert RUNOFF == 0.25
    assert runoff({0: [0.30], 1: [0.27], 2: [0.40]}, [0, 1, 2]) == [1, 0]  # 0.40 is past 25% of 0.27
    assert runoff({0: [0.30, 0.25], 1: [0.27, 0.33]}, [1, 0]) == []  # the last round: 0.33 past 0.25 x 1.25
    assert runoff({0: [0.30, 0.26], 1: [0.27, 0.28]}, [1, 0]) == [0, 1]
    assert runoff({1: [0.3], 2: [0.31]}, [0, 1, 2]) == [2, 1]  # 0 failed: not measured, not tried again
    assert runoff({0: [0.30]}, [0, 1]) == []


def test_the_winner_is_among_the_last_rounds_finalists_by_the_median_of_their_rounds():
    from pipezero.planner.trial_rounds import Trial, combined, room_for_round, winner

    a = combined([Trial("a", 1.0, 0.30), Trial("a", 1.0, 0.26), Trial("a", 1.0, 0.31)])
    assert a.trial_step_s == 0.30 and a.rounds_s == (0.30, 0.26, 0.31)
    b = combined([Trial("b", 1.0, 0.27), Trial("b", 1.0, 0.28), Trial("b", 1.0, 0.27)])
    out = combined([Trial("c", 1.0, 0.25)])  # fast once, left out of the runoff by a slower minute
    assert winner([a, b, out]) == 1
    failed = combined([Trial("d", 1.0, 0.2), Trial("d", 1.0, None, "rank 0: OutOfMemoryError")])
    assert failed.trial_step_s is None and failed.failed == "rank 0: OutOfMemoryError" and failed.rounds_s == (0.2,)
    assert winner([a, failed]) == 0
    assert room_for_round(2.0, [1.0, 1.5], 5.0, 2) and not room_for_round(2.5, [1.0, 1.5], 5.0, 2)


def test_trials_run_in_rounds_while_the_budget_holds_whole_ones(capsys, tmp_path, monkeypatch):
    """One process, the trials' steps faked: every candidate once, then the two within 25% of the
    fastest in reverse order, then no third round (one left near); with a budget for the first
    round only, it alone decides, with no line of a cut."""
    import pipezero.planner.auto_trials as auto_trials
    import pipezero.planner.trial_rounds as trial_rounds
    from pipezero.planner.auto_trials import settle_by_trials

    req = tiny_request(1, **{"run.out": str(tmp_path / "run"), "run.max_steps": "100"})
    first = provisional(req)
    tied = replace(first, ranked=[{**r, "predicted_step_s": 1.0 + i / 100} for i, r in enumerate(first.ranked)])
    req.trials = 3
    monkeypatch.setattr(trial_rounds, "shape_of", lambda ranked: ranked["flags"])  # each a shape of its own
    steps = {("0", "0"): 0.30, ("0", "1"): 0.27, ("0", "2"): 0.40, ("1", "1"): 0.33, ("1", "0"): 0.26}
    seen = []

    def fake(cfg):
        r, n = Path(cfg.run.out).name.split("-")
        seen.append((r, n))
        return steps[(r, n)]

    monkeypatch.setattr(auto_trials, "time_steps", fake)
    cfg = build_config(None, settings_of(req, first))
    picked = settle_by_trials(req, tied, cfg, {})
    out = capsys.readouterr().out
    assert seen == [("0", "0"), ("0", "1"), ("0", "2"), ("1", "1"), ("1", "0")], seen
    # the chosen one: rounds 0.30, 0.26 (median 0.28) against 0.27, 0.33 (0.30); the third, 0.40, out after one
    assert picked.chosen == tied.ranked[0] and picked.picked_by == "measured fastest in trials"
    assert [t["rounds_s"] for t in picked.trials] == [[0.30, 0.26], [0.27, 0.33], [0.40]]
    assert picked.trials[0]["trial_step_s"] == pytest.approx(0.28) and picked.trials_cut is None
    assert "trial 0.28 s (rounds 0.3, 0.26)" in out and "in rounds" in out, out
    # 10% of 100 steps at 0.035 s a step: 0.35 s; each faked trial takes 0.1 s of the trials' clock: the
    # first round fits (three), a second of two more does not
    seen.clear()
    clock = [0.0]

    def slow(cfg):
        clock[0] += 0.1
        return fake(cfg)

    monkeypatch.setattr(auto_trials, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(auto_trials, "time_steps", slow)
    short = replace(tied, ranked=[{**r, "predicted_step_s": r["predicted_step_s"] * 0.035} for r in tied.ranked])
    once = settle_by_trials(req, short, cfg, {})
    assert seen == [("0", "0"), ("0", "1"), ("0", "2")], seen
    assert once.chosen == short.ranked[1] and once.trials_cut is None  # 0.27 s against 0.30 s, one round


def test_the_trials_winner_is_trained_and_the_prediction_stays_the_models():
    from pipezero.planner.auto import LayoutChoice
    from pipezero.planner.auto_check import LayoutCheck
    from pipezero.planner.trial_rounds import PICKED_BY_MODEL, PICKED_BY_TRIALS, Trial, settled, trial_lines

    ranked = [{**r, "predicted_peak_gib": 1.0, "bubble": 0.1, "exposed_comm_s": 0.0, "predicted_compute_s": 0.2,
               "predicted_idle_s": 0.03} for r in ranked_of(0.238, 0.238, 0.239, 0.241)]
    choice = LayoutChoice(ranked, 4, 9, 0, 0.1, {})
    trials = [Trial("--pp 1", 0.238, 0.364), Trial("--pp 2", 0.238, None, "rank 1: out of memory"),
              Trial("--pp 3", 0.239, 0.2745)]
    picked = settled(choice, [0, 1, 2], trials, None)
    assert [r["flags"] for r in picked.ranked] == ["--pp 3", "--pp 1", "--pp 2", "--pp 4"]
    assert picked.picked_by == PICKED_BY_TRIALS and picked.chosen["predicted_step_s"] == 0.239
    lines = trial_lines(picked, 3.2)
    assert any(line.startswith("  --pp 3") and "trial 0.275" in line and "picked: measured fastest" in line
               for line in lines), lines
    assert any("dropped: rank 1: out of memory" in line for line in lines), lines
    again = LayoutChoice.from_json(json.loads(json.dumps(picked.to_json())))
    assert again == picked
    check = LayoutCheck(picked.to_json())
    check.observe({"step_time_s": 0.3, "bubble": 0.1}, True, False)
    check.observe({"step_time_s": 0.28, "bubble": 0.1}, False, True)
    entry, _ = check.summary(None)
    assert entry["flags"] == "--pp 3" and entry["predicted_step_s"] == 0.239  # the model's, not the trial's
    assert entry["picked_by"] == PICKED_BY_TRIALS and entry["trials_cut"] is None
    assert entry["trials"][2] == {"flags": "--pp 3", "predicted_step_s": 0.239, "trial_step_s": 0.2745}
    assert entry["trials"][1]["trial_step_s"] is None and "out of memory" in entry["trials"][1]["failed"]
    # one candidate measured: nothing compared, the model's order stands
    alone = settled(choice, [0, 1], [Trial("--pp 1", 0.238, 0.3), Trial("--pp 2", 0.238, None, "failed")], None)
    assert alone.ranked == ranked and alone.picked_by == PICKED_BY_MODEL
    assert any("fewer than two candidates were measured" in line for line in trial_lines(alone, 1.0))


def train_with_trials(rank: int, world: int, data: str, out: str) -> dict:
    """A rank of a --layout auto job whose two top layouts are near-ties (predictions set 1% apart):
    both are tried, and rank 1 reports the chosen one's trial slow, so
    only the slowest rank's time (an all-reduce MAX) gives both ranks the runner-up. First the
    runner-up trains without trials, as a reference for the losses."""
    from dataclasses import replace as change

    import pipezero.planner.auto_job as auto_job
    import pipezero.planner.auto_trials as auto_trials
    import pipezero.planner.trial_rounds as trial_rounds
    from pipezero.cli.train import decided
    from pipezero.engine import train

    settings = {"model.preset": "tiny", "model.n_layers": "2", "model.dim": "64", "data.seq_len": "32",
                "data.path": data, "data.tokenizer": "bytes", "run.max_steps": "3", "run.out": out,
                "run.progress": False, "run.sample_tokens": "0", "run.save_final": False, "parallel.timeout_s": "60"}
    req = request(None, settings, {}, None, 8, None, ranks=(world, world), trials=2)
    req.costs = fake_probe(1.0, 1.0)  # no probe: the trials are under test
    first = provisional(req)
    # predicted 100 s a step: the trials' budget (10% of 3 such steps) holds both on a loaded machine
    tied = [{**first.ranked[0], "predicted_step_s": 100.0}, {**first.ranked[1], "predicted_step_s": 101.0},
            *first.ranked[2:]]
    auto_job.decide = lambda req, first, cfg: (change(first, ranked=tied), None)
    timed, calls = auto_trials.time_steps, []

    def slow_on_rank_1(cfg):
        calls.append(cfg.run.out)
        step_s = timed(cfg)
        return 100.0 if rank == 1 and len(calls) == 1 else step_s

    auto_trials.time_steps = slow_on_rank_1
    trial_rounds.BUDGET_SHARE = 10.0  # a 3-step run's budget made to hold the trials (60 steps' would)
    runner_up = tied[1]
    alone = train(build_config(None, {**settings, **runner_up["settings"], "run.out": f"{out}-alone"}))
    cfg = build_config(None, settings_of(req, first))
    final, choice = decided(req, first, cfg, {})
    result = train(final, choice=choice)
    auto_trials.time_steps = timed
    return {"chosen": choice["ranked"][0]["flags"], "runner_up": runner_up["flags"], "losses": result.losses,
            "alone": alone.losses, "trials": choice["trials"], "calls": calls,
            # last: a trial failing mid-step leaves the process group unfit for anything after it
            "failing": failing_trials(rank, world, data, f"{out}-failing")}


@pytest.mark.distributed
def test_trials_settle_a_near_tie_alike_on_every_rank_and_leave_the_run_as_it_would_be(text_dir, tmp_path):
    """(In the same ranks, to share their start: a trial failing in set-up, then one failing mid-step;
    `failing_trials`.)"""
    from ranks import run_ranks

    out = tmp_path / "run"
    ranks = run_ranks(train_with_trials, 2, str(text_dir), str(out))
    check_failing_trials([r["failing"] for r in ranks])
    for r in ranks:
        assert r["chosen"] == r["runner_up"], r  # rank 1's slow trial counted on rank 0 too
        assert r["trials"] == ranks[0]["trials"]  # every rank measured the same times
        assert len(r["calls"]) == 2 and all(c.startswith(str(out / ".layout-trials")) for c in r["calls"])
        assert r["losses"] == r["alone"] and len(r["losses"]) == 3  # from step 0, as without trials
    trials = ranks[0]["trials"]
    assert trials[0]["trial_step_s"] == 100.0 and 0 < trials[1]["trial_step_s"] < 100.0, trials
    assert not (out / ".layout-trials").exists()
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == \
        sorted(p.name for p in (tmp_path / "run-alone").iterdir() if not p.name.startswith("."))
    entry = json.loads((out / "summary.json").read_text())["layout_choice"]
    assert entry["flags"] == ranks[0]["runner_up"] and entry["picked_by"] == "measured fastest in trials"
    assert entry["predicted_step_s"] == trials[1]["predicted_step_s"]  # the model's prediction, not the trial's
    assert [t["flags"] for t in entry["trials"]] == [t["flags"] for t in trials]


def test_a_failed_trial_drops_its_layout_and_the_budget_cuts_the_trials_short(capsys, tmp_path, monkeypatch):
    """One process, the trials' steps faked: a layout whose trial runs out of memory is dropped with
    its line and the next measured one trains; a budget too small for a second trial stops them."""
    import torch

    import pipezero.planner.auto_trials as auto_trials
    from pipezero.planner.auto_trials import settle_by_trials

    req = tiny_request(1, **{"run.out": str(tmp_path / "run"), "run.max_steps": "100"})
    req.trials = 3
    first = provisional(req)
    tied = replace(first, ranked=[{**r, "predicted_step_s": 1.0 + i / 100} for i, r in enumerate(first.ranked)])
    seen = []

    def fake(cfg):
        seen.append(cfg.run.out)
        assert (tmp_path / "run" / ".layout-trials").is_dir()
        if len(seen) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
        return {2: 0.6, 3: 0.4}[len(seen)]  # 0.6: past 25% of 0.4, no second round

    monkeypatch.setattr(auto_trials, "time_steps", fake)
    # a collection of the whole session's heap a trial (a third of a second each): counted, not run
    freed = []
    monkeypatch.setattr(auto_trials, "free_memory", lambda: freed.append(len(seen)))
    cfg = build_config(None, settings_of(req, first))
    picked = settle_by_trials(req, tied, cfg, {})
    out = capsys.readouterr().out
    assert freed == [1, 2, 3]  # after every trial, the failed one's too, before the next is built
    assert picked.chosen == tied.ranked[2] and picked.picked_by == "measured fastest in trials"
    assert picked.costs["trials_s"] > 0 and [t["trial_step_s"] for t in picked.trials] == [None, 0.6, 0.4]
    assert f"{tied.ranked[0]['flags']}: predicted 1 s, dropped: rank 0: OutOfMemoryError: CUDA out of memory. " \
           f"Tried to allocate 2.00 GiB\n" in out, out
    assert not (tmp_path / "run" / ".layout-trials").exists()
    # 10% of 100 steps at 0.01 s a step: 0.1 s, less than one trial; the chosen one's is tried all the same
    seen.clear()
    monkeypatch.setattr(auto_trials, "time_steps", lambda cfg: seen.append(cfg) or (time.sleep(0.2) or 0.3))
    small = replace(tied, ranked=[{**r, "predicted_step_s": r["predicted_step_s"] / 100} for r in tied.ranked])
    kept = settle_by_trials(req, small, cfg, {})
    out = capsys.readouterr().out
    assert len(seen) == 1 and kept.chosen == small.chosen and kept.picked_by == "model's choice"
    assert freed == [1, 2, 3, 1]
    assert "layout trials cut short after 1 of 3 candidates" in out and kept.trials_cut in out, out
    assert not (tmp_path / "run" / ".layout-trials").exists()
    # a run too short for two trials tries none, and says so
    seen.clear()
    short = tiny_request(1, **{"run.out": str(tmp_path / "run"), "run.max_steps": "8"})
    untried = settle_by_trials(short, tied, cfg, {})
    out = capsys.readouterr().out
    assert not seen and untried.ranked == tied.ranked and untried.trials == [] and untried.picked_by == "model's choice"
    assert out.startswith("layout trials skipped:") and untried.trials_cut in out, out
    assert freed == [1, 2, 3, 1]


def failing_trials(rank: int, world: int, data: str, out: str) -> dict:
    """A rank of a --layout auto job whose trials fail: first the chosen layout's set-up runs out of
    memory on every rank (nothing in flight: dropped, the next one tried), then a trial runs out of
    memory mid-step on rank 1 alone while rank 0 waits for its messages (the run stops)."""
    import torch

    import pipezero.planner.auto_trials as auto_trials
    from pipezero.engine import Trainer
    from pipezero.planner.auto_trials import TrialFailed, settle_by_trials

    settings = {"model.preset": "tiny", "model.n_layers": "2", "model.dim": "64", "data.seq_len": "32",
                "data.path": data, "data.tokenizer": "bytes", "run.max_steps": "100", "run.out": out,
                "run.progress": False, "run.sample_tokens": "0", "run.save_final": False, "parallel.timeout_s": "3"}
    req = request(None, settings, {}, None, 8, None, ranks=(world, world), trials=2)
    req.costs = fake_probe(1.0, 1.0)
    first = provisional(req)
    tied = replace(first, ranked=[{**first.ranked[0], "predicted_step_s": 10.0},
                                  {**first.ranked[1], "predicted_step_s": 10.1}, *first.ranked[2:]])
    cfg = build_config(None, settings_of(req, first))
    timed = auto_trials.time_steps
    calls = []

    def short_of_memory_first(cfg):
        calls.append(cfg.run.out)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
        return timed(cfg)

    auto_trials.time_steps = short_of_memory_first
    dropped = settle_by_trials(req, tied, cfg, {})
    auto_trials.time_steps = timed
    step = Trainer.step

    def short_of_memory_on_rank_1(self, s):
        if rank == 1 and s == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return step(self, s)

    Trainer.step = short_of_memory_on_rank_1
    try:
        settle_by_trials(req, tied, cfg, {})
        stopped = None
    except TrialFailed as e:
        stopped = str(e)
    return {"dropped": dropped.to_json(), "stopped": stopped, "scratch": (Path(out) / ".layout-trials").exists()}


def check_failing_trials(ranks: list[dict]) -> None:
    """`failing_trials`' results, rank by rank: the set-up failure dropped its layout on every rank
    alike, the mid-step one stopped every rank with one line naming its cause, not the peer's wait."""
    for r in ranks:
        trials = r["dropped"]["trials"]
        assert trials[0]["trial_step_s"] is None and trials[1]["trial_step_s"] > 0, trials
        assert trials[0]["failed"] == "rank 0: OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB"
        assert r["dropped"]["picked_by"] == "model's choice"  # one layout measured: nothing to compare
        assert r["stopped"] is not None and "failed (rank 1: OutOfMemoryError" in r["stopped"], r["stopped"]
        assert "rerun with --layout-trials 0" in r["stopped"] and "\n" not in r["stopped"]
        assert not r["scratch"]
    assert ranks[0]["stopped"] == ranks[1]["stopped"]


def test_a_trial_that_leaves_the_group_unfit_ends_train_in_one_line(capsys, tmp_path, monkeypatch):
    """train's own handling of a mid-step trial failure (raised here in a lone process, where the
    trials themselves never raise it): exit 1, its one line, and nothing of the run left in --out."""
    import pipezero.planner.auto_trials as auto_trials

    def unfit(req, choice, cfg, names):
        raise auto_trials.TrialFailed("--layout auto: the trial of --pp 1 failed (rank 1: OutOfMemoryError) after "
                                      "ranks had begun exchanging its messages")

    monkeypatch.setattr(auto_trials, "settle_by_trials", unfit)
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps(fake_probe(1.0, 1.0).to_json()))
    argv = ["train", "--preset", "tiny", "--layout", "auto", "--device", "cpu", "--costs", str(costs),
            "--seq-len", "64", "--out", str(tmp_path / "run")]  # the probe's length: no warning beside the line
    code, err = run_main(argv, capsys)
    assert code == 1 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pipezero: error: --layout auto: the trial of --pp 1"), err
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_a_trials_ranks_answer_the_hang_doctor_in_the_run_folder(text_dir, tmp_path, monkeypatch):
    """SIGUSR1 to the launcher during the trials asks in RUN/doctor, and `pipezero doctor RUN` reads
    there: a trial's ranks watch the run folder, not their scratch folder (where no one asked, so no
    rank answered and the doctor found no record)."""
    import pipezero.engine as engine
    from pipezero.config import ScheduleKind as K
    from pipezero.planner.auto_trials import time_steps
    from pipezero.rundir import TRIALS, run_of_trial
    from training import tiny_overrides

    run = tmp_path / "run"
    trial = run / TRIALS / "0-1"
    trial.mkdir(parents=True)
    watched, start = [], engine.start_watch
    monkeypatch.setattr(engine, "start_watch", lambda cfg, stage, out=None: watched.append(out) or start(cfg, stage, out))
    assert time_steps(build_config(None, tiny_overrides(str(text_dir), str(trial), 1, 1, K.ONE_F_ONE_B, 2))) > 0
    assert watched == [run]
    with pytest.raises(ValueError, match="not a layout trial's folder"):
        run_of_trial(tmp_path / "elsewhere")
