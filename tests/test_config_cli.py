import json
import subprocess
import sys

import pytest
import torch

from pipezero.cli import main
from pipezero.config import ScheduleKind
from pipezero.settings import build_config
from pipezero.errors import ConfigError


def test_defaults_preset_toml_and_overrides(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('[model]\npreset = "small"\n[parallel]\nmicrobatches = 8\nschedule = "zb-h1"\n[run]\nseed = 5\n')
    cfg = build_config(str(toml), {"run.seed": 9})
    assert cfg.model.preset == "small" and cfg.model.dim == 320
    assert cfg.parallel.microbatches == 8 and cfg.parallel.schedule is ScheduleKind.ZB_H1
    assert cfg.run.seed == 9  # the command line wins over the file
    assert cfg.global_batch == 8 * cfg.parallel.micro_batch_size


@pytest.mark.parametrize("overrides,needle", [
    ({"model.preset": "huge"}, "unknown preset 'huge'"),
    ({"data.path": "/no/such/dir"}, "does not exist"),
    ({"data.seq_len": 5000}, "longer than the model allows"),
    ({"parallel.schedule": "fancy"}, "expected one of gpipe"),
    ({"parallel.pp": 8, "parallel.virtual_stages": 1}, "only 4 layers"),
    ({"parallel.schedule": "interleaved-1f1b", "parallel.virtual_stages": 1}, "needs --virtual-stages >= 2"),
    ({"parallel.stage_layers": [1, 1]}, "lists 2 stages"),
    ({"parallel.zero": 4}, "parallel.zero = 4: expected an integer >= 0 and <= 3"),
    ({"run.bogus": 1}, "unknown setting"),
    ({"run.keep_checkpoints": 0}, "run.keep_checkpoints = 0: expected an integer >= 1"),
    ({"run.max_bad_steps": 0}, "run.max_bad_steps = 0: expected an integer >= 1"),
    ({"run.device": "tpu"}, "expected one of auto, cpu, cuda"),
])
def test_validation_errors_name_the_fix(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        build_config(None, overrides)


def test_bad_toml_is_a_config_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        build_config(str(bad))
    bad.write_text("[weird]\nx = 1\n")
    with pytest.raises(ConfigError, match="unknown table"):
        build_config(str(bad))


def test_a_settings_file_past_its_bound_is_refused_unread(tmp_path, capsys):
    """A settings file is a few hundred bytes: one of 100 MB was read whole by the launcher and every
    rank (hundreds of MiB each to parse), with no bound a user could read."""
    from one_line import assert_one_line, run_main

    big = tmp_path / "big.toml"
    with big.open("w") as f:  # sparse: 2 MiB of nothing after a valid table
        f.write("[run]\nmax_steps = 1\n")
        f.truncate(2 << 20)
    assert_one_line(*run_main(["train", "--config", str(big)], capsys),
                    f"config file {str(big)!r} is 2.0 MiB: a settings file is at most 1 MiB")


@pytest.mark.parametrize("argv,needle", [
    (["train", "--preset", "nope"], "unknown preset"),
    (["train", "--data", "/missing/file.txt"], "does not exist"),
    (["train", "--seq-len", "99999"], "longer than the model allows"),
    (["train", "--nproc", "3", "--pp", "1", "--dp", "2"], "make them equal"),
    *([(["train", "--device", "cuda"], "torch sees no CUDA device")] if not torch.cuda.is_available() else []),
])
def test_cli_errors_exit_2_without_traceback(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


@pytest.mark.distributed
@pytest.mark.parametrize("module", ["pipezero.cli", "pipezero"])  # the launcher's way in, and a user's
def test_console_script_reports_error_as_exit_2(module):
    proc = subprocess.run([sys.executable, "-m", module, "train", "--preset", "nope"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown preset" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.distributed  # full lane: seconds of one-process training or planning
def test_short_training_run_loss_falls(tmp_path, text_dir):
    out = tmp_path / "run"
    rc = main(["train", "--preset", "tiny", "--data", str(text_dir), "--tokenizer", "bytes", "--max-steps", "40",
               "--seq-len", "64", "--eval-every", "20", "--out", str(out), "--no-progress", "--lr", "0.01"])
    assert rc == 0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 41))
    for key in ("step", "loss", "lr", "grad_norm", "tokens", "step_time_s", "tokens_per_s"):
        assert key in lines[0]
    first = sum(r["loss"] for r in lines[:5]) / 5
    last = sum(r["loss"] for r in lines[-5:]) / 5
    assert last < first - 1.0, (first, last)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_heldout_loss"] < summary["unigram_baseline"]


@pytest.mark.distributed  # full lane: seconds of one-process training or planning
def test_training_is_deterministic_for_a_seed(tmp_path, text_dir):
    from pipezero.engine import train

    def run(name):
        cfg = build_config(None, {"data.path": str(text_dir), "data.tokenizer": "bytes", "run.max_steps": 3,
                                  "data.seq_len": 32, "run.out": str(tmp_path / name), "run.progress": False,
                                  "run.sample_tokens": 0})
        return train(cfg).losses

    assert run("a") == run("b")


def test_device_choice_and_backend_without_a_gpu(monkeypatch):
    """What can be checked of the GPU path on a machine without one: the backend a CUDA rank asks
    for, and the error for a local rank with no GPU of its own (raised before any process group)."""
    from pipezero.config import Device
    from pipezero.parallel.device import backend, device_kind, rank_device

    assert backend(torch.device("cpu")) == "gloo"
    assert backend(torch.device("cuda", 3)) == "cpu:gloo,cuda:nccl"
    assert device_kind(Device.CPU) == "cpu"
    assert device_kind(Device.AUTO) == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setenv("LOCAL_RANK", str(torch.cuda.device_count()))
    with pytest.raises(ConfigError, match=f"local rank {torch.cuda.device_count()} needs GPU"):
        rank_device("cuda")


def test_a_rank_takes_omp_num_threads_where_set_else_its_share_of_the_cores():
    """Without --threads a rank takes OMP_NUM_THREADS (the launcher sets cores / ranks; the tests
    set 1 so that two workers never spin against each other), else its share of the cores."""
    import os

    from pipezero.engine import default_threads

    cores = os.cpu_count() or 1
    assert default_threads(1, {"OMP_NUM_THREADS": "3"}) == 3
    assert default_threads(4, {}) == max(1, cores // 4) and default_threads(1, {}) == cores
    for ignored in ("0", "-2", "two", "", "100000"):  # OpenMP's own to refuse; ours the cores' share
        assert default_threads(1, {"OMP_NUM_THREADS": ignored}) == cores


@pytest.mark.parametrize("argv", [["train", "--max-steps", "1"], ["simulate", "--memory"], ["verify"]])
def test_a_model_deeper_than_the_limit_is_refused_at_once(argv, tmp_path, capsys):
    """n_layers = 200000: the memory model walks every layer, past 120 s for simulate --memory and
    66 s before train could refuse it. The bound is model.n_layers' range, on the configuration
    reference page, said before any work."""
    import time

    from one_line import assert_one_line

    toml = tmp_path / "deep.toml"
    toml.write_text('[model]\npreset = "tiny"\nn_layers = 200000\n')
    t0 = time.process_time()  # this process's CPU: the layers walked, not a loaded machine's wait
    try:
        code = main([*argv, "--config", str(toml), "--out", str(tmp_path / "o")] if argv[0] != "simulate"
                    else [*argv, "--config", str(toml)])
    except SystemExit as e:
        code = e.code
    assert_one_line(code, capsys.readouterr().err, "model.n_layers = 200000: expected an integer >= 1 and <= 4096")
    assert time.process_time() - t0 < 10


# A setting only another option reads, given without it: accepted, it changed nothing (exit 0). Each
# is refused in one line naming the option that would read it, as a flag and as a TOML key.
UNREAD = [
    (["--pp", "2", "--dp", "2", "--zero", "3", "--zero3-prefetch", "4"], "[parallel]\npp = 2\ndp = 2\nzero = 3\n"
     "zero3_prefetch = 4\n", "is read only by ZeRO-3 layer by layer; with --pp 2 ZeRO-3 keeps each chunk gathered"),
    (None, "[parallel]\ndp = 2\nzero = 2\nzero3_keep_gathered = false\n",
     "is read only by ZeRO-3 (its parameter gathers)"),
    (["--dp", "2", "--zero", "3", "--no-overlap-gather"], "[parallel]\ndp = 2\nzero = 3\noverlap_gather = false\n",
     "is read only by ZeRO-1 and -2"),
    (["--dp", "2", "--buckets-in-flight", "3"], "[parallel]\ndp = 2\nbuckets_in_flight = 3\n",
     "is read only by ZeRO-1 to 3"),
    (None, "[parallel]\ndp = 2\nranks_per_node = 1\n", "is read only by --hierarchical and --secondary-shard node"),
    (["--dp", "2", "--placement", "pp-inner"], "[parallel]\ndp = 2\nplacement = \"pp-inner\"\n",
     "at --pp 1 --dp 2 every placement is the same ranks"),
    (["--pp", "2", "--stage-layers", "3,3", "--partition", "cost"],
     "[parallel]\npp = 2\nstage_layers = [3, 3]\npartition = \"cost\"\n", "without --stage-layers"),
    (None, "[run]\ntrace_steps = 2\n", "is read only by --trace"),
    (["--pp", "2", "--sample-tokens", "20"], "[parallel]\npp = 2\n[run]\nsample_tokens = 20\n",
     "the end-of-run text sample is made only without a pipeline"),
    (["--no-save-final", "--keep-checkpoints", "2"], "[run]\nsave_final = false\nkeep_checkpoints = 2\n",
     "where checkpoints are saved"),
    (None, "[model]\nwindow_layers = [0]\n", "is read only with model.sliding_window"),
    (["--checkpoint-every", "5", "--no-save-final"], "[run]\nmax_steps = 1\ncheckpoint_every = 5\nsave_final = false\n",
     "a run of --max-steps 1 with --no-save-final saves none: lower it to 1 or less"),
    # one replica: ZeRO's collectives are copies within a group of one
    *[(flags, f"[parallel]\nzero = {zero}\n{key}\n", "at --dp 1 there is one replica and nothing to exchange")
      for flags, zero, key in ((["--zero", "2", "--buckets-in-flight", "3"], 2, "buckets_in_flight = 3"),
                               (["--zero", "3", "--zero3-unit", "sublayer"], 3, 'zero3_unit = "sublayer"'),
                               (["--zero", "3", "--zero3-prefetch", "2"], 3, "zero3_prefetch = 2"),
                               (["--zero", "1", "--no-overlap-gather"], 1, "overlap_gather = false"))],
]


@pytest.mark.parametrize("argv,toml,needle", UNREAD)
def test_a_setting_read_only_by_another_option_is_refused_without_it(argv, toml, needle, tmp_path, capsys):
    from one_line import assert_one_line, run_main

    if argv is not None:  # the flag, as typed
        code, err = run_main(["train", *argv, "--max-steps", "1", "--out", str(tmp_path / "o")], capsys)
        assert_one_line(code, err, needle)
        assert not (tmp_path / "o").exists()
    path = tmp_path / "run.toml"  # the TOML key, named as the file spells it
    path.write_text(toml)
    with pytest.raises(ConfigError, match="in " + str(path).replace(".", r"\.")) as e:
        build_config(str(path))
    assert needle in str(e.value)


@pytest.mark.parametrize("settings", [
    {"parallel.zero": "3", "parallel.dp": "2", "parallel.zero3_prefetch": "4"},  # P = 1: layer by layer
    {"parallel.pp": "2", "parallel.dp": "2", "parallel.zero": "3", "parallel.zero3_keep_gathered": False,
     "parallel.zero3_prefetch": "2"},
    {"parallel.dp": "2", "parallel.zero": "1", "parallel.overlap_gather": False, "parallel.buckets_in_flight": "2"},
    {"parallel.dp": "4", "parallel.hierarchical": True, "parallel.ranks_per_node": "2"},
    {"parallel.pp": "2", "parallel.dp": "2", "parallel.placement": "pp-inner"},
    {"run.trace": True, "run.trace_steps": "2"},
    {"run.sample_tokens": "20"}, {"parallel.pp": "2", "run.sample_tokens": "0"},
    {"run.checkpoint_every": "2", "run.save_final": False, "run.keep_checkpoints": "2"},
    {"model.sliding_window": "8", "model.window_layers": "0"},
])
def test_the_same_settings_with_the_option_that_reads_them_pass(settings):
    build_config(None, settings)


@pytest.mark.parametrize("argv,needle", [
    (["--pp", "2", "--stage-layers", "5,-1"], "--stage-layers 5,-1: expected a list of integers, each >= 0"),
    (["--gpu-memory", "inf"], "--gpu-memory inf: expected a finite number > 0"),
    (["--zero", "3", "--dp", "2", "--no-overlap-gather"], "--no-overlap-gather is read only by ZeRO-1 and -2"),
])
def test_a_bad_value_is_named_for_what_is_wrong_with_it(argv, needle, tmp_path, capsys):
    """A list with a negative count is a list of integers; inf is a number > 0 but not a finite one;
    a switch is named as typed, without the value it stores (False)."""
    from one_line import assert_one_line, run_main

    code, err = run_main(["train", *argv, "--max-steps", "1", "--out", str(tmp_path / "o")], capsys)
    assert_one_line(code, err, needle)
    assert "False" not in err


def test_a_dangling_out_link_is_named_with_its_target(tmp_path, capsys):
    """mkdir through a link to nothing says "File exists", naming neither the link nor its target."""
    from one_line import assert_one_line, run_main

    (tmp_path / "o").symlink_to(tmp_path / "gone")
    code, err = run_main(["train", "--max-steps", "1", "--out", str(tmp_path / "o")], capsys)
    assert_one_line(code, err, f"--out '{tmp_path / 'o'}' is a symlink to {tmp_path / 'gone'}, which does not exist")
    assert not (tmp_path / "gone").exists()


@pytest.mark.parametrize("schedule,v", [("zb-v", 2), ("interleaved-1f1b", 2), ("dualpipe-v", 2), ("1f1b", 1)])
def test_a_schedule_named_alone_gets_its_fewest_chunks_as_simulate_gives_it(schedule, v):
    """simulate and plan read --schedule zb-v alone as V = 2; train refused it (in two wordings):
    one behaviour for the same flags."""
    from pipezero.schedules.registry import default_virtual
    from pipezero.config import ScheduleKind as K

    cfg = build_config(None, {"parallel.schedule": schedule, "parallel.pp": "2"})
    assert cfg.parallel.virtual_stages == v == default_virtual(K(schedule))


def test_the_zero_help_says_what_each_stages_rules_say(capsys):
    """`--zero`'s help is read from the rules table the lowering, runtime and memory model ask:
    a stage's line names its reduction and its gathers exactly when its rules do."""
    from dataclasses import replace

    from pipezero.schedules.zero_rules import RULES

    for rules in RULES.values():
        text = rules.describe()
        assert ("reduce-scatter" in text) == rules.reduces_to_shard, text
        assert ("all-gather of the updated weights" in text) == rules.gathers_updates, text
        assert ("parameters before use" in text) == rules.sharded_params, text
    changed = replace(RULES[1], gathers_updates=False)
    assert "all-gather" not in changed.describe()
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert all(rules.describe() in shown for rules in RULES.values())



def test_each_rank_of_the_launcher_gets_its_device_once():
    """The launcher decides each rank's device (auto resolved, ranks sharing a GPU) and puts it in
    place of any --device the user gave, so a rank's command line names one device."""
    from pipezero.launch import with_device

    assert with_device(["train", "--device", "cuda", "--pp", "2", "--device=auto"], "cpu") == \
        ["train", "--pp", "2", "--device", "cpu"]
