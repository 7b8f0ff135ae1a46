"""`pipezero probe`: this machine's costs at a run's shapes, bounded in time, written for the planner."""

from __future__ import annotations

import json

import pytest
import torch

from one_line import assert_one_line, run_main
from pipezero.cli import main
from pipezero.probe import Probe, probe
from pipezero.settings import build_config


def test_a_probe_measures_compute_and_the_host_in_its_budget_and_round_trips_as_json():
    cfg = build_config(None, {"model.preset": "tiny", "data.seq_len": 32, "parallel.micro_batch_size": 2})
    found = probe(cfg, torch.device("cpu"), budget_s=0.02)
    assert set(found.block_s) == {"F", "B", "W"} and all(t > 0 for t in found.block_s.values())
    assert found.tflops > 0 and 0 < found.overhead_s < found.block_s["F"] + found.block_s["W"]
    assert found.host_copy_gbps > 0 and found.host_adamw_params_s > 0
    assert found.seconds < 10  # repetitions stop at the budget; a few warm-ups and the first ones past it
    again = Probe.from_json(json.loads(json.dumps(found.to_json())))
    assert again == found


def test_the_probe_command_writes_a_new_file_only_and_reads_no_layout(tmp_path, capsys):
    out = tmp_path / "probe.json"
    code, _ = run_main(["probe", "--preset", "tiny", "--seq-len", "32", "--budget", "0.02", "--json", str(out)], capsys)
    assert code == 0 and Probe.from_json(json.loads(out.read_text())).seq_len == 32
    assert_one_line(*run_main(["probe", "--preset", "tiny", "--json", str(out)], capsys), "name a new file")
    assert_one_line(*run_main(["probe", "--budget", "60"], capsys), "--budget 60: expected seconds from")
    assert_one_line(*run_main(["probe", "--pp", "2"], capsys), "unrecognized arguments: --pp 2")


def test_plan_with_a_probes_costs_plans_with_its_rates_and_refuses_what_it_would_not_read(tmp_path, capsys):
    def plan_with(tflops: float, *extra: str) -> tuple[int, str]:
        path = tmp_path / f"probe-{tflops}.json"
        found = Probe("cpu", "fp32", 2, 128, {"F": 0.01, "B": 0.01, "W": 0.01}, tflops, 0.0, host_copy_gbps=10.0,
                      host_adamw_params_s=1e9)
        path.write_text(json.dumps(found.to_json()))
        argv = ["plan", "--preset", "small", "--gpus", "2", "--gpu-memory", "1", "--device", "cpu", "--seq-len", "128",
                "--global-batch", "16", "--json", "--costs", str(path), *extra]
        if extra:
            return run_main(argv, capsys)
        assert main(argv) == 0
        return 0, capsys.readouterr().out

    steps = [json.loads(plan_with(tflops)[1])["layouts"][0]["step_time_s"] for tflops in (0.01, 0.02)]
    assert steps[0] / steps[1] == pytest.approx(2.0, rel=0.05)  # compute-bound: twice the rate, half the step
    assert_one_line(*plan_with(0.01, "--mfu", "0.3"), "measured what --mfu would say: drop one of them")
    bad = tmp_path / "bad.json"
    bad.write_text('{"device": "cpu"}')
    assert_one_line(*run_main(["plan", "--preset", "small", "--gpus", "2", "--gpu-memory", "1", "--costs", str(bad)],
                              capsys), "not a probe pipezero wrote")


def probe_links(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from pipezero.probe import probe_link

    # Budgets that differ by rank stand for clocks that do (a loaded machine): each rank's own
    # clock would end its loop after another count, and the ranks' all-reduces would not pair up.
    found = probe_link(dist.group.WORLD, torch.device("cpu"), budget_s=0.0 if rank == 0 else 0.2)
    after = torch.tensor([float(rank)])
    dist.all_reduce(after)  # still paired: no rank ran an all-reduce more than another
    return {"latency_s": found.latency_s, "gbps": found.gbps, "after": after.item()}


@pytest.mark.distributed
def test_a_link_probe_times_an_all_reduce_at_two_sizes_on_every_rank_alike():
    from ranks import run_ranks

    results = run_ranks(probe_links, 2)
    for r in results:
        assert 0 < r["latency_s"] < 1 and r["gbps"] > 0 and r["after"] == 1.0, r
