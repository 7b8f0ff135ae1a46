"""`plan` and `simulate` refuse what they cannot answer in one line, exit 2: sizes past
what answers within seconds (schedules/limits.py), values that overflow, files they cannot write, flags
they would ignore. All in this process (cluster's refusals: test_bad_cluster.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from one_line import assert_one_line, run_main

PLAN = ["plan", "--preset", "tiny", "--gpus", "8", "--gpu-memory", "80"]

# (argv, what the one line must say); {tmp} is the test's folder, {file} a file in it
CASES = [
    # 40 million stage micro-batches grew past 3.5 GB before a MemoryError
    (["simulate", "--pp", "4", "--microbatches", "10000000"],
     "--pp 4 x --microbatches 10000000 x V 1 = 40000000 stage micro-batches to play; the limit is 16384, a few "
     "seconds' work: choose --microbatches 4096 or fewer"),
    (["simulate", "--schedule", "zb-v", "--pp", "256", "--microbatches", "256"],
     "= 131072 stage micro-batches to play; the limit is 16384, a few seconds' work: choose --microbatches 32 or"),
    (["simulate", "--pp", "1000000", "--microbatches", "4"], "--pp = 1000000: expected an integer >= 1 and <= 1024"),
    # every schedule but dualpipe-v (M >= 2P)
    (["simulate", "--compare", "--pp", "64", "--microbatches", "64"], "over --compare's 8 schedules"),
    (["simulate", "--schedule", "interleaved-1f1b", "--virtual-stages", "100000", "--pp", "2", "--microbatches", "2"],
     "x V 100000 = 400000 stage micro-batches to play; the limit is 16384"),
    (["simulate", "--zero", "1", "--dp", "100000"], "--dp = 100000: expected an integer >= 1 and <= 1024"),
    (["simulate", "--zero", "2", "--pp", "8", "--dp", "64", "--microbatches", "64"],
     "x --dp 64 = 32768 stage micro-batches to play; the limit is 4096 with --zero"),
    (["simulate", "--zero", "3", "--zero3-layerwise", "--grad-reduce", "microbatch", "--preset", "70b", "--pp", "4",
      "--dp", "16", "--microbatches", "64"], "the lowered program has 600128 instructions over its ranks; the limit is 80000"),
    (["simulate", "--cost", "1e308:1e308:1"], "--cost 1e308:1e308:1: expected three numbers > 0 (from 1e-06 to 1e+06"),
    (["simulate", "--cost", "1:1e-320:1"], "--cost 1:1e-320:1: expected three numbers > 0 (from 1e-06 to 1e+06"),
    (["simulate", "--comm", "1e308"], "--comm = 1e+308: expected a number >= 0 and <= 1000000"),
    (["simulate", "--zero", "1", "--dp-comm", "1e308"], "--dp-comm = 1e+308: expected a number >= 0 and <= 1000000"),
    (["simulate", "--zero", "1", "--optim-cost", "1e308"], "--optim-cost = 1e+308: expected a number >= 0 and <= 1000000"),
    (["simulate", "--png", "{tmp}"], "is a folder: name the .png file to write"),
    (["simulate", "--png", "{file}/x.png"], "cannot be written"),
    (["simulate", "--png", "{tmp}/x.txt"], "--png {tmp}/x.txt: name a file ending .png"),
    (["simulate", "--png", "{tmp}/no/such/x.png"], "--png {tmp}/no/such/x.png: its folder {tmp}/no/such does not exist"),
    (["simulate", "--pp", "4", "--microbatches", "1024", "--png", "{tmp}/x.png"],
     "--png draws at most 512 stage micro-batches"),
    (["simulate", "--from-trace", "{tmp}"], "is a folder: pass the trace.json"),
    (["simulate", "--from-trace", "{file}", "--png", "{tmp}/x.png"], "--from-trace takes no --png"),
    (["simulate", "--from-trace", "{file}", "--zero", "1"], "--from-trace takes no --zero"),
    (["simulate", "--dp", "4"], "--dp applies with --zero"),
    (["simulate", "--listing"], "--listing applies with --zero"),
    (["simulate", "--preset", "70b"], "--preset applies with --zero"),
    (["plan", "--preset", "70b", "--gpus", "100000", "--gpu-memory", "80"],
     "--gpus = 100000: expected an integer >= 1 and <= 65536"),
    (["plan", "--preset", "tiny", "--gpus", "1073741824", "--gpu-memory", "80"],
     "--gpus = 1073741824: expected an integer >= 1 and <= 65536"),
    (["plan", "--preset", "tiny", "--gpu-memory", "80", "--nodes", "100000000", "--gpus-per-node", "8"],
     "--nodes = 100000000: expected an integer >= 1 and <= 65536"),
    (["plan", "--preset", "tiny", "--gpu-memory", "80", "--nodes", "1024", "--gpus-per-node", "1024"],
     "--nodes 1024 x --gpus-per-node 1024 = 1048576 GPUs; the limit is 65536"),
    # nothing splits 65521 GPUs (pp <= 80 layers, dp dividing 1024): a StopIteration traceback before
    (["plan", "--preset", "70b", "--gpus", "65521", "--gpus-per-node", "1", "--gpu-memory", "80"], "choose --gpus 64512 or 65536 or another"),
    # a scan down from the count ran for minutes
    (["plan", "--preset", "tiny", "--gpus", "65535", "--gpus-per-node", "1", "--gpu-memory", "80"], "choose --gpus 2048 or another"),
    (["plan", "--preset", "tiny", "--gpus", "3", "--gpu-memory", "80", "--global-batch", "1"],
     "choose --gpus 2 or another --global-batch"),
    ([*PLAN, "--global-batch", "1000000000"], "--global-batch = 1000000000: expected an integer >= 1 and <= 1048576"),
    (["plan", "--preset", "tiny", "--gpus", "1", "--gpu-memory", "80", "--global-batch", "1048576", "--seq-len", "64"],
     "runs more micro-batches a rank than the planner simulates within its time budget"),
    (["plan", "--params", "1e30", "--gpus", "8", "--gpu-memory", "80"],
     "--params = 1e+30: expected a number >= 1000000 and <= 1e+13"),
    (["plan", "--params", "1", "--gpus", "8", "--gpu-memory", "80"],
     "--params = 1.0: expected a number >= 1000000 and <= 1e+13"),
    ([*PLAN[:-1], "8e10"], "--gpu-memory = 80000000000.0: expected a number > 0 and <= 16384"),
    ([*PLAN, "--tflops", "1e-300"], "--tflops = 1e-300: expected a number >= 1e-06 and <= 100000"),
    ([*PLAN, "--overhead-ms", "1e308"], "--overhead-ms = 1e+308: expected a number >= 0 and <= 1000000"),
    ([*PLAN, "--intra-bw", "1e-300"], "--intra-bw = 1e-300: expected a number >= 1e-06 and <= 1000000"),
    ([*PLAN, "--inter-bw", "1e308"], "--inter-bw = 1e+308: expected a number >= 1e-06 and <= 1000000"),
    ([*PLAN, "--bandwidth", "1e308,1e-308"], "--bandwidth 1e308,1e-308: expected two numbers > 0 (from 1e-06 to 1e+06"),
    ([*PLAN, "--net-cpu", "1e308"], "--net-cpu = 1e+308: expected a number >= 0 and <= 10000"),
    ([*PLAN, "--quant-block", "1000000000000"], "--quant-block = 1000000000000: expected an integer >= 1 and <= 1048576"),
    (["simulate", "--quantize-grads", "int8"], "--quantize-grads applies with --zero"),
    # a part-filled node: its links were priced as a whole node's, without a word
    ([*PLAN, "--gpus-per-node", "3"], "--gpus 8 is not a whole number of nodes of --gpus-per-node 3 (2 nodes and 2 "
                                      "GPUs of another): give a multiple of 3"),
    ([*PLAN, "--secondary-shard", "node"], "--secondary-shard node is read only across nodes"),
    # train's cap on a step's tokens binds, not memory: the plan proposed layouts train refuses
    ([*PLAN, "--global-batch", "1048576", "--seq-len", "512"], "--global-batch 1048576 x --seq-len 512 = 536870912 "
                                                               "tokens a step; train's limit is 268435456"),
    ([*PLAN[:-1], "0.0001"], "no layout fits 1.48M parameters in 8 x 0.0001 GiB"),  # not "0.0B parameters"
]


def filled(argv: list[str], tmp_path: Path) -> list[str]:
    (tmp_path / "file").write_text("{}")
    return [a.replace("{tmp}", str(tmp_path)).replace("{file}", str(tmp_path / "file")) for a in argv]


@pytest.mark.parametrize("argv,needle", CASES, ids=[" ".join(c[0][:5]) for c in CASES])
def test_bad_plan_or_simulate_request_is_one_line_at_once(argv, needle, tmp_path, capsys):
    t0 = time.process_time()  # this process's CPU: the work refused, not a loaded machine's wait
    code, err = run_main(filled(argv, tmp_path), capsys)
    assert time.process_time() - t0 < 5
    assert_one_line(code, err, needle.replace("{tmp}", str(tmp_path)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing written


def test_a_png_through_a_symlink_or_into_a_missing_folder_is_refused(tmp_path, capsys):
    """A link at --png was replaced by the picture (its target left as it was); a missing folder was
    made, with every folder above it, wherever a typo put it."""
    (tmp_path / "target.png").write_bytes(b"theirs")
    (tmp_path / "link.png").symlink_to(tmp_path / "target.png")
    assert_one_line(*run_main(["simulate", "--png", str(tmp_path / "link.png")], capsys),
                    f"--png {tmp_path / 'link.png'} is a symlink (to {tmp_path / 'target.png'})")
    assert (tmp_path / "link.png").is_symlink() and (tmp_path / "target.png").read_bytes() == b"theirs"
    assert_one_line(*run_main(["simulate", "--png", str(tmp_path / "typo" / "t.png")], capsys), "does not exist")
    assert not (tmp_path / "typo").exists()


def test_a_failed_drawing_leaves_the_png_that_was_there(tmp_path, capsys, monkeypatch):
    """--png replaces its file whole or not at all: a drawing that fails midway leaves the old one."""
    import matplotlib.figure

    from pipezero.cli import main

    png = tmp_path / "t.png"
    png.write_bytes(b"the user's picture")

    def broken(self, path, **kw):  # noqa: ANN001 - matplotlib's signature
        Path(path).write_bytes(b"half a pic")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", broken)
    code, err = run_main(["simulate", "--pp", "2", "--microbatches", "2", "--png", str(png)], capsys)
    assert_one_line(code, err, f"--png {png} cannot be written")
    assert png.read_bytes() == b"the user's picture"
    assert [p.name for p in tmp_path.iterdir()] == ["t.png"]
    monkeypatch.undo()
    assert main(["simulate", "--pp", "2", "--microbatches", "2", "--png", str(png)]) == 0
    assert png.read_bytes().startswith(b"\x89PNG")


def test_the_planner_plays_within_its_budget_and_says_what_it_left_out(capsys, monkeypatch):
    """Layouts are simulated cheapest first until the budget is spent; the rest are counted, and
    the table and JSON say so with the fix."""
    import json

    from pipezero.cli import main
    from pipezero.config import ModelConfig
    from pipezero.models import apply_preset
    from pipezero.planner import search as planner
    from pipezero.schedules import limits
    from pipezero.planner.layouts import Cluster

    model = apply_preset(ModelConfig(), "small")
    # a budget of 5000 actions: 138 layouts played, 902 left out (20000 played 312 in 2.7 times the CPU)
    result = planner.plan_within(model, Cluster(8, 80.0), 1024, 1024, budget=5000)
    assert result.skipped > 0 and result.considered > 0 and result.played <= 5000
    assert all(planner.sim_actions(e.layout) <= 5000 for e in result.fits)
    monkeypatch.setattr(limits, "PLAN_BUDGET", 5000)
    assert main(["plan", "--preset", "small", "--gpus", "8", "--gpu-memory", "80", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["skipped"] == result.skipped and out["considered"] == result.considered
    assert main(["plan", "--preset", "small", "--gpus", "8", "--gpu-memory", "80"]) == 0
    assert f"{result.skipped} layouts of many micro-batches not simulated" in capsys.readouterr().out


def _trace(layout: object, events: list[dict] | None = None) -> dict:
    """A trace.json as a 2-rank gpipe run writes it (2 steps of 4 micro-batches), or with `events`."""
    evs = events or [{"ph": "X", "pid": r, "cat": c, "name": f"{r}{c}{m}", "args": {"step": s},
                      "ts": 1000 * s + 10 * m + 3 * r + (5 if c == "B" else 0), "dur": 4}
                     for s in (1, 2) for r in (0, 1) for m in range(4) for c in ("F", "B")]
    return {"traceEvents": evs, "otherData": {"layout": layout}}


LAYOUT = {"pp": 2, "dp": 1, "schedule": "gpipe", "microbatches": 4, "virtual_stages": 1}
ONE_F = {"ph": "X", "pid": 0, "cat": "F", "name": "0F0", "args": {"step": 1}, "ts": 0}
TRACE_CASES = [
    # grew past 3 GB for minutes
    # 10^10 x (1 traced + 14 chunks a micro-batch over every schedule's what-if)
    (_trace({**LAYOUT, "pp": 100000, "microbatches": 100000}), "asks for 150000000000 stage micro-batches"),
    # tracebacks: ValueError, TypeError, KeyError
    (_trace({**LAYOUT, "schedule": "bogus"}), "schedule 'bogus' is none of pipezero's"),
    (_trace({**LAYOUT, "pp": "2"}), "must be integers >= 1"),
    (_trace({}), "otherData.layout lacks schedule"),
    # named in the file's terms, not as Python's KeyError
    (_trace(LAYOUT, [ONE_F]), "(an event or its layout lacks its 'dur' field)"),
    (_trace(LAYOUT, [{**ONE_F, "dur": -5}]), "event '0F0' has ts 0 and dur -5: finite times >= 0 only"),
    (_trace({**LAYOUT, "pp": 1, "virtual_stages": 1}), "an event of rank 1, but the layout has pp x dp = 1"),
    # exit 0 with a comparison of nothing: M = 0, times past a float
    (_trace({**LAYOUT, "microbatches": 0}), "must be integers >= 1"),
    (_trace(LAYOUT, [{**ONE_F, "dur": 1e308}, {**ONE_F, "pid": 1, "name": "1F0", "ts": 1e308, "dur": 1e308}]),
     "its times overflow"),
    (_trace(LAYOUT, [{**ONE_F, "dur": 4}]), "compute events of chunks [0], but the layout has chunks 0 to 1"),
]


@pytest.mark.parametrize("trace, needle", TRACE_CASES, ids=[c[1][:30] for c in TRACE_CASES])
def test_a_trace_pipezero_did_not_write_is_one_line(trace, needle, tmp_path, capsys):
    import json

    (tmp_path / "trace.json").write_text(json.dumps(trace))
    t0 = time.process_time()  # this process's CPU: the work refused, not a loaded machine's wait
    assert_one_line(*run_main(["simulate", "--from-trace", str(tmp_path / "trace.json")], capsys), needle)
    assert time.process_time() - t0 < 5
    (tmp_path / "trace.json").write_text(json.dumps(_trace(LAYOUT)))  # the same run as written: compared
    assert run_main(["simulate", "--from-trace", str(tmp_path / "trace.json")], capsys)[0] == 0


@pytest.mark.parametrize("argv, needle", [
    # without --memory nothing reads the file's pp = 2
    (["simulate", "--config", "{toml}"], "--config applies with --memory: add --memory, or drop --config"),
    (["simulate", "--seq-len", "64"], "--seq-len applies with --memory"),
    (["simulate", "--zero", "1", "--recompute"], "--recompute applies with --memory"),
    (["train", "--gpu-memory", "-1"], "--gpu-memory -1: expected a number > 0"),  # a bound, not "does not fit -1 GiB"
    (["train", "--gpu-memory", "nan"], "--gpu-memory nan: expected a finite number > 0"),
    (["simulate", "--eval-batches", "2"], "--eval-batches applies with --memory"),
    (["simulate", "--sample-tokens", "4096"], "--sample-tokens applies with --memory"),
    # --compare plays every schedule at its own V: the one named, and its V, were unread
    (["simulate", "--compare", "--schedule", "zb-h1"], "--schedule is unread by --compare"),
    (["simulate", "--compare", "--virtual-stages", "3"], "--virtual-stages is unread by --compare"),
    (["simulate", "--zero", "1", "--json", "--listing"], "--listing prints every rank's program as text, which --json "
                                                          "leaves out"),
    (["simulate", "--zero", "1", "--quant-block", "64"], "--quant-block 64 sizes the scales of quantized traffic: add "
                                                         "--quantize-weights or --quantize-grads"),
    # documented as train's (it chooses for --link-gbps): argparse said "invalid int value"
    (["simulate", "--memory", "--zero", "3", "--dp", "2", "--zero3-prefetch", "auto"],
     "--zero3-prefetch auto is train's"),
    (["simulate", "--zero", "3", "--zero3-layerwise", "--zero3-prefetch", "two"], "--zero3-prefetch two: expected an "
                                                                                 "integer >= 1"),
    (["train", "--host-memory", "0"], "--host-memory 0: expected a number > 0"),
    # CPU ranks' device is the host: nothing is offloaded, so nothing reads a host limit
    (["plan", "--preset", "tiny", "--gpus", "2", "--gpu-memory", "8", "--device", "cpu", "--host-memory", "64"],
     "--host-memory 64 prices --offload optimizer, which plan does not propose for --device cpu"),
    (["plan", "--preset", "tiny", "--gpus", "2", "--gpu-memory", "8", "--host-memory", "2.5e11"],
     "--host-memory = 250000000000.0: expected a number >= 0 and <= 1048576"),
])
def test_a_flag_the_request_would_ignore_or_misread_is_one_line(argv, needle, tmp_path, capsys):
    (tmp_path / "run.toml").write_text("[parallel]\npp = 2\n")
    argv = [a.replace("{toml}", str(tmp_path / "run.toml")) for a in argv]
    assert_one_line(*run_main(argv, capsys), needle)


def test_plan_refuses_a_quant_block_it_would_not_use(capsys):
    """As train does: without a --quantize-* flag the block size changes nothing in the plan."""
    argv = ["plan", "--preset", "tiny", "--gpus", "2", "--gpu-memory", "8", "--global-batch", "4", "--seq-len", "64"]
    assert_one_line(*run_main([*argv, "--quant-block", "64"], capsys), "--quant-block 64 prices quantized traffic")
    assert run_main([*argv, "--quant-block", "64", "--quantize-grads", "int8"], capsys)[0] == 0


@pytest.mark.parametrize("cost", ["-1,1,1", "-1:1:1", "-0.5:1:1"])
def test_a_negative_cost_reaches_its_own_check(cost, capsys):
    """argparse takes `--cost -1,1,1` for an option ("expected one argument"): the value must reach
    the check that names what is wrong with it."""
    code, err = run_main(["simulate", "--cost", cost], capsys)
    assert_one_line(code, err, f"--cost")
    assert "expected one argument" not in err and cost in err


def test_a_negative_number_still_reaches_a_numeric_flag(capsys):
    assert_one_line(*run_main(["simulate", "--comm", "-1"], capsys), "--comm = -1.0: expected a number >= 0")


def test_plan_refuses_memory_no_layout_can_fit_before_simulating_any(capsys, monkeypatch):
    """`plan --preset 7b --gpus 8 --gpu-memory 0.001`: simulating every layout would take minutes on a
    busy host to say none fits; the weights' share of one GPU says it at once."""
    def never(*args, **kwargs):
        raise AssertionError("the planner ran")

    monkeypatch.setattr("pipezero.planner.search.plan_within", never)
    assert_one_line(*run_main(["plan", "--preset", "7b", "--gpus", "8", "--gpu-memory", "0.001"], capsys),
                    "no layout fits 6.74B parameters in 8 x 0.001 GiB: their fp32 weights alone")


@pytest.mark.parametrize("extra", [["--zero3-layerwise"], ["--zero3-prefetch", "2"], ["--zero3-prefetch-chunk"]])
@pytest.mark.parametrize("zero", ["0", "1", "2"])
def test_simulate_refuses_zero3_flags_under_another_stage(zero, extra, capsys):
    """simulate --zero 1 --zero3-prefetch-chunk would play ZeRO-1 with the flag unread: refused, as train does."""
    code, err = run_main(["simulate", "--zero", zero, "--dp", "2", *extra, "--json"], capsys)
    assert_one_line(code, err, f"{extra[0]} is read only by ZeRO-3")


@pytest.mark.parametrize("flags", [["--zero3-layerwise", "--zero3-prefetch", "2"], ["--zero3-prefetch-chunk"]])
def test_simulate_takes_zero3_flags_with_zero3(flags, capsys):
    """Each where its layout reads it: the depth layer by layer, the chunk what-if kept gathered."""
    assert run_main(["simulate", "--zero", "3", "--dp", "2", *flags, "--json"], capsys)[0] == 0


def test_simulate_refuses_quantized_weights_under_zero0(capsys):
    """ZeRO-0 has no parameter gather to quantize: the flag would be unread, so it is refused, as train does."""
    code, err = run_main(["simulate", "--zero", "0", "--dp", "2", "--quantize-weights", "int8", "--json"], capsys)
    assert_one_line(code, err, "--quantize-weights int8 with --zero 0: ZeRO-0 gathers no weights")


@pytest.mark.parametrize("zero", ["1", "2", "3"])
def test_simulate_takes_quantized_weights_where_weights_are_gathered(zero, capsys):
    assert run_main(["simulate", "--zero", zero, "--dp", "2", "--quantize-weights", "int8", "--json"], capsys)[0] == 0


def test_simulate_takes_quantized_grads_under_zero0(capsys):
    assert run_main(["simulate", "--zero", "0", "--dp", "2", "--quantize-grads", "int8", "--json"], capsys)[0] == 0
