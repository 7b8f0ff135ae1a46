"""`pipezero probe`: this machine's costs at a run's shapes, bounded in time, written for the planner."""

from __future__ import annotations

import json
import time

import pytest
import torch

from one_line import assert_one_line, run_main
from pipezero.cli import main
from pipezero.probe import Probe, probe
from pipezero.settings import build_config


def test_a_probe_measures_compute_and_the_host_in_its_budget_and_round_trips_as_json():
    # a micro-batch whose block's time the fixed cost of an action does not hide (ProbeError)
    # (small's block: ~30 ms of F, B and W against ~0.7 ms of fixed cost on an idle core, ~40x; tiny's
    # ~20x fell under the 3x bound beside a loaded suite)
    cfg = build_config(None, {"model.preset": "small", "data.seq_len": 128, "parallel.micro_batch_size": 4})
    cpu = time.process_time()
    found = probe(cfg, torch.device("cpu"), budget_s=0.02, host=True)
    cpu = time.process_time() - cpu
    assert set(found.block_s) == {"F", "B", "W"} and all(t > 0 for t in found.block_s.values())
    assert found.tflops > 0 and 0 < found.overhead_s < found.block_s["F"] + found.block_s["W"]
    assert found.host_copy_gbps > 0 and found.host_adamw_params_s > 0
    # repetitions stop at the budget; a few warm-ups and the first ones past it. This process's CPU,
    # not found.seconds: a loaded machine's waits (wall time 11-21 s beside three busy processes) are
    # not the probe's work
    assert found.seconds > 0 and cpu < 10, (found.seconds, cpu)
    again = Probe.from_json(json.loads(json.dumps(found.to_json())))
    assert again == found


def test_the_probe_command_writes_a_new_file_only_and_reads_no_layout(tmp_path, capsys):
    out = tmp_path / "probe.json"
    # a micro-batch whose block's time the fixed cost of an action does not hide (ProbeError)
    code, _ = run_main(["probe", "--preset", "small", "--seq-len", "128", "--micro-batch-size", "4", "--budget", "0.02",
                        "--json", str(out)], capsys)
    assert code == 0 and Probe.from_json(json.loads(out.read_text())).seq_len == 128
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

    from pipezero.probe import block_together, job_cores, probe_link

    # Budgets that differ by rank stand for clocks that do (a loaded machine): each rank's own
    # clock would end its loop after another count, and the ranks' all-reduces would not pair up.
    found = probe_link(dist.group.WORLD, torch.device("cpu"), budget_s=0.0 if rank == 0 else 0.2)
    after = torch.tensor([float(rank)])
    dist.all_reduce(after)  # still paired: no rank ran an all-reduce more than another
    cfg = build_config(None, {"model.preset": "tiny", "data.seq_len": "16", "parallel.micro_batch_size": "1"})
    together = block_together(cfg, torch.device("cpu"), budget_s=0.0 if rank == 0 else 0.05, timeout_s=60.0)
    return {"latency_s": found.latency_s, "gbps": found.gbps, "after": after.item(), "cores": job_cores(60.0),
            "together": together, "cpu_s_per_gb": found.cpu_s_per_gb}


@pytest.mark.distributed
def test_a_link_probe_times_an_all_reduce_at_two_sizes_on_every_rank_alike():
    from ranks import run_ranks

    import os

    results = run_ranks(probe_links, 2)
    for r in results:
        assert 0 <= r["latency_s"] < 1 and r["gbps"] > 0 and r["after"] == 1.0, r
        # gloo's copies and sums cost CPU a byte (a loaded host's noise can hide it in two sizes'
        # difference: then none), far under a thousand CPU-seconds a GB
        assert 0 <= r["cpu_s_per_gb"] < 1000, r
    # both ranks on this host: its cores once, not once a rank
    assert [r["cores"] for r in results] == [len(os.sched_getaffinity(0))] * 2, results
    # the block timed on both ranks at once, as many times each: one mean, the same on both
    assert results[0]["together"] == results[1]["together"] > 0, results


def test_the_cores_a_job_gets_are_its_ranks_over_how_much_slower_they_compute_together():
    """Four ranks whose block takes twice as long all at once as alone get two cores' worth; four
    times as long (other jobs on the host take half of its two cores), one; no slower, a core each.
    Never more than its hosts have."""
    from pipezero.probe import effective_cores

    assert effective_cores(4, 0.01, 0.02, 2) == pytest.approx(2.0)
    assert effective_cores(4, 0.01, 0.04, 2) == pytest.approx(1.0)
    assert effective_cores(4, 0.01, 0.01, 64) == pytest.approx(4.0)
    assert effective_cores(4, 0.01, 0.012, 2) == 2  # noise that says more than the hosts have


def test_ranks_of_one_host_share_its_cores_and_hosts_add_theirs():
    """The emulated cluster's nodes (network namespaces) are one host: its ranks share its cores,
    pinned or not; separate hosts each bring their own."""
    from pipezero.probe import cores_of

    assert cores_of([("a", {0, 1})] * 4) == 2
    assert cores_of([("a", {0}), ("a", {0}), ("a", {1}), ("a", {1})]) == 2  # nodes pinned to a core each
    assert cores_of([("a", {0, 1}), ("a", {0, 1}), ("b", {0, 1}), ("b", {0, 1})]) == 4


def write_probe(path, **changed) -> str:
    """A probe's file as `probe --json` writes it, with `changed` fields in place of its own."""
    found = Probe("cpu", "fp32", 2, 128, {"F": 0.01, "B": 0.01, "W": 0.01}, 0.01, 0.0, host_copy_gbps=10.0,
                  host_adamw_params_s=1e9).to_json()
    path.write_text(json.dumps({**found, **changed}))
    return str(path)


PLAN = ["plan", "--preset", "small", "--gpus", "2", "--gpu-memory", "1", "--seq-len", "128", "--global-batch", "16"]


@pytest.mark.parametrize("text, needle", [
    ("[1, 2]", "not a probe pipezero wrote (a JSON object was expected, not a list)"),
    (json.dumps({"device": "cpu", "links": [1]}), "not a probe pipezero wrote (links"),
    (json.dumps({"device": None}), "not a probe pipezero wrote (device: a string was expected"),
])
def test_plan_costs_that_are_not_a_probes_object_are_one_line(text, needle, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    assert_one_line(*run_main([*PLAN, "--device", "cpu", "--costs", str(bad)], capsys), needle)


@pytest.mark.parametrize("changed, needle", [
    ({"tflops": 754974.72}, "tflops 754974.72 is outside what --tflops accepts"),
    ({"tflops": True}, "tflops true is not a number"),
    ({"host_copy_gbps": 1e9}, "host_copy_gbps 1e+09 is outside what --pcie-gbps accepts"),
    ({"host_adamw_params_s": 1.0}, "host_adamw_params_s 1 is outside what --cpu-adamw accepts"),
    ({"overhead_s": 1e9}, "overhead_s 1e+09 is outside what --overhead-ms accepts"),
    # a link kind the planner never looks up: the file's links were read as none, without a word
    ({"links": {"nodes": {"latency_s": 1e-4, "gbps": 10.0}}}, 'links: "nodes" is no link a probe times'),
    ({"links": {"node": {"latency_s": -5.0, "gbps": 10.0}}}, "links.node.latency_s -5 is outside"),
    ({"cores": 0}, "cores 0 is not a count of cores"),
    ({"cores": -1}, "cores -1 is not a count of cores"),
    ({"cores": "2"}, 'cores "2" is not a count of cores'),
])
def test_plan_costs_outside_the_flags_ranges_are_refused(changed, needle, tmp_path, capsys):
    """A probe's figures replace the flags': they are held to the flags' ranges (a busy machine's probe
    once wrote 7.5e5 TFLOP/s, which plan took as given)."""
    path = write_probe(tmp_path / "probe.json", **changed)
    assert_one_line(*run_main([*PLAN, "--device", "cpu", "--costs", path], capsys), needle)


def test_plan_costs_from_another_device_kind_are_refused(tmp_path, capsys):
    """A CPU rank's FLOP rate is not a GPU's: a plan for GPUs from it priced a step at days."""
    path = write_probe(tmp_path / "probe.json")
    assert_one_line(*run_main([*PLAN, "--costs", path], capsys),
                    "was measured on cpu, and plan prices --device cuda: probe on the GPU")
    gpu = write_probe(tmp_path / "gpu.json", device="NVIDIA H100 80GB HBM3")
    assert_one_line(*run_main([*PLAN, "--device", "cpu", "--costs", gpu], capsys),
                    "was measured on NVIDIA H100 80GB HBM3, and plan prices --device cpu")


def test_plan_costs_through_a_link_reads_the_probe_it_names(tmp_path, capsys):
    path = write_probe(tmp_path / "probe.json")
    link = tmp_path / "latest.json"
    link.symlink_to(path)
    assert main([*PLAN, "--device", "cpu", "--json", "--costs", str(link)]) == 0
    assert json.loads(capsys.readouterr().out)["layouts"]


def test_probe_json_under_a_file_is_refused_before_the_probe_runs(tmp_path, capsys):
    (tmp_path / "taken").write_text("x")
    assert_one_line(*run_main(["probe", "--preset", "tiny", "--json", str(tmp_path / "taken" / "p.json")], capsys),
                    "is not a folder")


def test_a_probe_too_big_for_this_machine_is_refused_before_it_allocates(tmp_path, capsys):
    """B x T of a block's activations past the machine's memory was the kernel's kill (exit 137)."""
    assert_one_line(*run_main(["probe", "--preset", "tiny", "--micro-batch-size", "100000"], capsys),
                    "more than this machine's")


@pytest.mark.parametrize("size, needle", [
    ("100000000", "--micro-batch-size x --seq-len = 12800000000 tokens in the one micro-batch the probe times"),
    ("1000000", "more than this machine's"),  # one micro-batch within the limit, four past it: M is not probe's
])
def test_a_probe_past_the_batch_limit_names_its_own_flags(size, needle, capsys):
    """The probe times one micro-batch: train's step limit blamed --microbatches and --dp, which
    probe does not have (and the default four micro-batches refused one micro-batch within it)."""
    code, err = run_main(["probe", "--preset", "tiny", "--seq-len", "128", "--micro-batch-size", size], capsys)
    assert_one_line(code, err, needle)
    assert "--microbatches" not in err and "--dp" not in err


def test_a_rate_the_fixed_cost_hides_is_not_written():
    """Where the block at the run's micro-batch takes no longer than three actions' fixed cost, the
    FLOP rate cannot be told apart from it (it came out as FLOPs over 1e-9 s)."""
    from pipezero.probe import ProbeError, achieved_tflops

    assert achieved_tflops(3e9, {"F": 0.001, "B": 0.001, "W": 0.001}, 0.0) == pytest.approx(1.0)
    with pytest.raises(ProbeError, match="cannot be told apart from an action's fixed cost"):
        achieved_tflops(3e9, {"F": 0.03, "B": 0.8, "W": 1.0}, 0.99)


def test_a_link_whose_large_all_reduce_is_no_slower_gets_a_bandwidth_it_at_least_has(monkeypatch):
    """Two sizes' times whose difference is noise (the large no slower than the small) would claim
    any bandwidth at all; the large all-reduce's own rate stands instead, and a real difference is
    read as before: its bandwidth from the difference, a message's latency the small one's time less
    its bytes at that bandwidth, over the ring's steps."""
    import torch.distributed as dist

    import pipezero.probe as probe

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(probe, "agreed_most", lambda value, group, device: value)
    large = probe.large_size(0.001)
    # two ranks: a ring all-reduce is two messages one after the other, each paying the latency
    for small, big, gbps, latency in ((0.010, 0.009, probe.large_size(0.010) / 0.009 / 1e9, 0.009 / 2),
                                      (0.001, 0.011, (large - probe.SMALL) / 0.010 / 1e9,
                                       (0.001 - probe.SMALL * 0.010 / (large - probe.SMALL)) / 2)):
        times = iter((small, big))
        monkeypatch.setattr(probe, "timed_together", lambda *args, **kwargs: next(times))
        found = probe.probe_link(None, torch.device("cpu"))
        assert found.gbps == pytest.approx(gbps) and found.latency_s == pytest.approx(latency)


def test_a_links_cpu_a_gb_is_the_two_sizes_cpu_difference_over_their_bytes(monkeypatch):
    """On CPU ranks the bytes a collective moves cost the CPU (gloo's copies and sums, the kernel's
    network path): CPU-seconds a call of each size, their difference over the difference of the
    bytes a rank's link carries, is what a GB costs; a GPU's collective is priced at none."""
    import torch.distributed as dist

    import pipezero.probe as probe

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(probe, "agreed_most", lambda value, group, device: value)
    calls = iter(((0.001, 0.0005), (0.011, 0.0105)))

    def timed(*args, cpu=None, **kwargs):
        wall, used = next(calls)
        cpu.append(used)
        return wall

    monkeypatch.setattr(probe, "timed_together", timed)
    found = probe.probe_link(None, torch.device("cpu"))
    moved = 2 * 3 / 4 * (probe.large_size(0.001) - probe.SMALL)  # a ring's bytes through a rank's link
    assert found.cpu_s_per_gb == pytest.approx(0.010 / (moved / 1e9))


def test_a_slow_links_bandwidth_is_timed_with_fewer_bytes():
    """The large all-reduce is sized by the small one's time: over 100 Mbit (64 KB in ~20 ms) four
    times the small, not the 4 MB that took 0.6 s a call; on a fast link the largest."""
    from pipezero.probe import LARGE_S, LARGEST, SMALL, large_size

    assert large_size(0.02) == 4 * SMALL
    assert large_size(1e-5) == LARGEST
    for t in (1e-4, 5e-4, 2e-3, 1e-2):
        size = large_size(t)
        assert 4 * SMALL <= size <= LARGEST and (size == 4 * SMALL or t * size / SMALL <= LARGE_S)
        assert size == LARGEST or t * size * 4 / SMALL > LARGE_S  # the largest that fits


def test_probe_json_where_nothing_can_be_written_is_refused_before_the_probe_runs(capsys):
    """A folder no file can be made in (here /proc) was found only after the seconds of timing, as
    a traceback from the temporary file's creation."""
    assert_one_line(*run_main(["probe", "--preset", "tiny", "--json", "/proc/probe.json"], capsys),
                    "--json '/proc/probe.json': no file can be written in /proc")


def test_a_block_too_slow_to_probe_here_is_refused_after_one_forward(monkeypatch):
    """Each figure takes a warm-up and at least three timed calls whatever --budget says: a 7b block
    on CPU ran past minutes. The first forward's time says what the rest would take."""
    import pipezero.probe as probes
    from pipezero.probe import ProbeError

    monkeypatch.setattr(probes, "MOST_S", 1e-6)
    cfg = build_config(None, {"model.preset": "tiny", "data.seq_len": 32, "parallel.micro_batch_size": 1})
    with pytest.raises(ProbeError, match=r"one forward of the block took .* the probe would take about"):
        probe(cfg, torch.device("cpu"), budget_s=0.02)


def test_costs_that_cannot_be_read_name_the_path_given_and_where_its_link_leads(tmp_path, capsys):
    """"--costs: passwd is not JSON" named neither the file the user gave nor that it was a link."""
    link = tmp_path / "probe.json"
    (tmp_path / "passwd").write_text("root:x:0:0")
    link.symlink_to(tmp_path / "passwd")
    assert_one_line(*run_main([*PLAN, "--device", "cpu", "--costs", str(link)], capsys),
                    f"--costs {link} (a link to {tmp_path / 'passwd'}): passwd is not JSON")
    assert_one_line(*run_main([*PLAN, "--device", "cpu", "--costs", str(tmp_path)], capsys),
                    f"--costs {tmp_path}: {tmp_path.name} is not a plain file")


def test_costs_through_a_link_loop_is_one_line_naming_the_loop(tmp_path, capsys):
    """A link that leads back to itself raised pathlib's RuntimeError while its target was looked up."""
    loop = tmp_path / "probe.json"
    loop.symlink_to(loop)
    assert_one_line(*run_main([*PLAN, "--device", "cpu", "--costs", str(loop)], capsys),
                    f"--costs {loop}: a link that leads back to itself")


def test_probe_json_dash_prints_the_json_and_writes_no_file_named_dash(tmp_path, capsys, monkeypatch):
    """`--json -` wrote a file named "-" (and said "wrote -"), where a dash means standard output."""
    import os

    import pipezero.probe as probes

    monkeypatch.chdir(tmp_path)
    measured = Probe("cpu", "fp32", 4, 128, {"F": 0.01, "B": 0.01, "W": 0.01}, 0.5, 1e-4, host_copy_gbps=5.0,
                     host_adamw_params_s=1e8)
    monkeypatch.setattr(probes, "probe", lambda *args, **kwargs: measured)
    assert main(["probe", "--preset", "tiny", "--json", "-"]) == 0
    out = capsys.readouterr().out
    assert Probe.from_json(json.loads(out)) == measured and not os.path.lexists(tmp_path / "-")


def test_a_collective_slower_than_the_budget_is_timed_once_per_least_call_after_its_warm_up(monkeypatch):
    """Each call of a 4 MB all-reduce over 100 Mbit takes 0.6 s: where no rank's budget allows more
    than the `least` calls that estimate its time, those calls are the figure, not timed again."""
    import torch.distributed as dist

    from pipezero import probe

    monkeypatch.setattr(dist, "all_reduce", lambda *args, **kwargs: None)  # one rank: its count is the group's
    calls = []

    def slow():
        calls.append(1)
        time.sleep(0.02)

    t = probe.timed_together(slow, 0.01, None, torch.device("cpu"))
    assert len(calls) == 1 + 3 and 0.02 <= t < 1, (len(calls), t)
    calls.clear()
    probe.timed_together(lambda: calls.append(1), 0.01, None, torch.device("cpu"))
    assert len(calls) > 1 + 3 + 3  # a fast call: the budget's count, after the three that estimated it
