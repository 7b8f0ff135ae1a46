"""A fresh review of bad inputs (issue 33, round three): the cases it found mishandled, each one
line naming the input, exit 2, before anything trains. One process each (the fast lane)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from one_line import assert_one_line, run_main

DEEP = "[" * 100_000 + "]" * 100_000  # nested past what Python's json reader follows: a RecursionError
TRAIN = ["train", "--preset", "tiny", "--max-steps", "1", "--no-progress", "--seq-len", "16"]


def test_a_config_file_that_is_a_folder_or_not_text_is_one_line(tmp_path, capsys):
    (tmp_path / "dir.toml").mkdir()
    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe\x00")
    assert_one_line(*run_main(["train", "--config", str(tmp_path / "dir.toml")], capsys),
                    "dir.toml' is a folder; name a .toml file")
    assert_one_line(*run_main(["train", "--config", str(tmp_path / "bin.toml")], capsys),
                    "bin.toml' is not valid TOML: 'utf-8' codec can't decode byte 0xff")


@pytest.mark.parametrize("argv, needle", [
    ([*TRAIN, "--data", ""], "--data '' is empty: name document files"),  # was "--out is inside --data ''"
    ([*TRAIN, "--model", ""], "--model is empty: name a local Hugging Face model folder"),
    (["export", "", "--out", "e"], "the source is empty: pass a run directory"),
    ([*TRAIN, "--quant-block", "7"], "--quant-block 7 applies with --quantize-weights or --quantize-grads"),  # ignored
    ([*TRAIN, "--timeout", "0.5"], "--timeout 0.5: expected a number >= 1 and <= 604800"),
    ([*TRAIN, "--timeout", "1e-300"], "--timeout 1e-300: expected a number >= 1"),  # 0 ms: every connect failed
])
def test_an_empty_or_ignored_or_unusable_value_is_one_line(argv, needle, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert_one_line(*run_main(argv, capsys), needle)


def test_quant_block_from_toml_alone_is_named_by_its_key(tmp_path, capsys):
    (tmp_path / "run.toml").write_text("[parallel]\nquant_block = 64\n")
    assert_one_line(*run_main(["train", "--config", str(tmp_path / "run.toml")], capsys),
                    "parallel.quant_block 64 applies with --quantize-weights or --quantize-grads")


def test_a_file_name_that_is_not_utf8_is_hashed_as_its_bytes(tmp_path):
    """A document named with a byte UTF-8 cannot hold was a UnicodeEncodeError traceback."""
    from pipezero.data.sources import fingerprint

    odd = tmp_path / os.fsdecode(b"x\xff.txt")
    odd.write_text("hello")
    assert len(fingerprint([odd])) == 16


@pytest.mark.parametrize("env, needle", [
    ({"RANK": "0", "WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not a rank number"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK='-1' is not a rank number"),
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "x"}, "LOCAL_RANK='x' is not a rank number"),
    ({"RANK": "1", "WORLD_SIZE": "1"}, "RANK=1 is not a rank of WORLD_SIZE=1"),
])
def test_torchrun_variables_set_by_hand_are_checked(env, needle):
    from pipezero.errors import ConfigError
    from pipezero.launch import check_rank_variables

    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        check_rank_variables(env)
    check_rank_variables({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "29500"})
    check_rank_variables({"WORLD_SIZE": "abc"})  # without RANK nothing reads them


@pytest.mark.parametrize("name, make, needle", [
    ("summary.json", Path.mkdir, "summary.json is a folder, where the run writes a file"),
    ("trace.json", Path.mkdir, "trace.json is a folder, where the run writes a file"),
    ("metrics.jsonl", os.mkfifo, "metrics.jsonl is not a regular file"),
    ("checkpoints", lambda p: p.write_text("x"), "checkpoints is a file, where the run writes a folder"),
    ("tensorboard", lambda p: p.write_text("x"), "tensorboard is a file, where the run writes a folder"),
    (".run-id", Path.mkdir, ".run-id is a folder, where the run writes a file"),  # an IsADirectoryError
])
def test_a_run_name_of_the_other_kind_is_refused_before_training(name, make, needle, tmp_path, capsys):
    """Each was a traceback (or a hang, for a pipe) after the training, when first written."""
    out = tmp_path / "o"
    out.mkdir()
    make(out / name)
    data = tmp_path / "a.txt"
    data.write_text("hello there " * 50)
    assert_one_line(*run_main([*TRAIN, "--data", str(data), "--out", str(out), "--force"], capsys), needle)
    assert sorted(p.name for p in out.iterdir()) == [name]  # no lock, no run id left behind


def test_json_nested_too_deep_is_one_line_wherever_it_is_read(tmp_path, capsys):
    from pipezero.checkpoint import CheckpointError
    from pipezero.checkpoint.store import read_manifest
    from pipezero.errors import ConfigError
    from pipezero.models.hf import read_json
    from pipezero.telemetry.metrics import _records

    (tmp_path / "config.json").write_text(DEEP)
    with pytest.raises(ConfigError, match="config.json is not readable json: maximum recursion depth"):
        read_json(tmp_path / "config.json")
    (tmp_path / "manifest.json").write_text(DEEP)
    with pytest.raises(CheckpointError, match="unreadable manifest.json: maximum recursion depth"):
        read_manifest(tmp_path)
    assert _records(f'{DEEP}\n{{"step": 1}}\n') == [{"step": 1}]  # a resume skips the line
    (tmp_path / "trace.json").write_text(DEEP)
    assert_one_line(*run_main(["simulate", "--from-trace", str(tmp_path / "trace.json")], capsys),
                    "is not a pipezero trace.json (RecursionError")


def test_the_end_sample_of_non_finite_weights_stops_instead_of_failing():
    """--lr 1e308: the one step's update left every weight NaN; torch.multinomial raised."""
    from pipezero.generate import sample

    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.full((8,), float("nan")))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.w.expand(*ids.shape, 8)

    assert sample(Broken(), [1, 2], 5, 16, 0) == [1, 2]


def test_a_spec_module_that_exits_on_import_is_one_line(tmp_path, capsys, monkeypatch):
    """It ended pipezero with its own status: exit 0, nothing trained, nothing said."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(0)\n")
    assert_one_line(*run_main(["train", "--model-spec", "exits_on_import:X", "--max-steps", "1"], capsys),
                    "--model-spec 'exits_on_import:X': importing exits_on_import called sys.exit(0)")


def test_a_run_id_that_is_not_text_claims_nothing(tmp_path):
    """A binary .run-id was a UnicodeDecodeError traceback on --resume; now it is read as a missing one."""
    from pipezero.rundir import RUN_ID, run_id

    (tmp_path / RUN_ID).write_bytes(b"\xff\xfe")
    assert run_id(tmp_path) is None


@pytest.mark.parametrize("out, needle", [("a-file", "--out 'a-file' is a file: name a folder for verify's runs"),
                                         ("", "--out '' is empty: name a folder for verify's runs")])
def test_verify_out_that_is_a_file_or_empty_is_one_line(out, needle, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("mine")
    assert_one_line(*run_main(["verify", "--preset", "tiny", "--steps", "1", "--out", out], capsys), needle)
    assert (tmp_path / "a-file").read_text() == "mine"


@pytest.mark.parametrize("argv, needle", [
    # its pp = 2 was ignored, exit 0
    (["simulate", "--config", "{toml}"], "--config applies with --memory: add --memory, or drop --config"),
    (["simulate", "--seq-len", "64"], "--seq-len applies with --memory"),
    (["simulate", "--zero", "1", "--recompute"], "--recompute applies with --memory"),
    (["train", "--gpu-memory", "-1"], "--gpu-memory -1: expected a number > 0"),  # was "does not fit -1 GiB"
    (["train", "--gpu-memory", "nan"], "--gpu-memory nan: expected a number > 0"),
])
def test_a_flag_the_request_would_ignore_or_misread_is_one_line(argv, needle, tmp_path, capsys):
    (tmp_path / "run.toml").write_text("[parallel]\npp = 2\n")
    argv = [a.replace("{toml}", str(tmp_path / "run.toml")) for a in argv]
    assert_one_line(*run_main(argv, capsys), needle)


# (what is under RUN, the status, what stderr says): files by a record's name that no rank wrote are
# named as such (round seven: they were "no flight records", exit 1, as if none had been written), and
# a record or summary.json of the wrong shape is one line
DOCTOR_CASES = [
    ("deep", 2, "rank-00000.json under"),  # RecursionError traceback
    ("pipe", 2, "are not flight records as pipezero writes them"),  # the read waited forever
    ("shapes", 2, "rank-00000.json, rank-00001.json, rank-00002.json under"),  # [] / rank "x" / {}: KeyError
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


def test_a_text_field_with_no_records_to_read_it_from_is_one_line(tmp_path, capsys):
    """Text files are read whole: --text-field was ignored, exit 0."""
    (tmp_path / "a.txt").write_text("hello there " * 50)
    argv = [*TRAIN, "--data", str(tmp_path / "a.txt"), "--text-field", "body", "--out", str(tmp_path / "o")]
    assert_one_line(*run_main(argv, capsys), "--text-field 'body' names a field of .jsonl/.json/.parquet records")


def test_a_link_rate_in_other_digits_is_refused_before_anything_is_built():
    """'٣mbit' (an Arabic-Indic 3) passed the check and failed inside tc, after the namespaces were made."""
    from pipezero.cluster import ClusterSpec
    from pipezero.errors import ConfigError

    with pytest.raises(ConfigError, match="--link '٣mbit': a tc rate such as 200mbit"):
        ClusterSpec(nodes=2, link="٣mbit")
    ClusterSpec(nodes=2, link="2.5gbit")


@pytest.mark.parametrize("missing", ["SLURM_LOCALID", "SLURM_NTASKS"])
def test_a_slurm_step_variable_missing_is_one_line(missing):
    """A hand-made srun environment lacking one of srun's variables was a KeyError traceback."""
    from pipezero.errors import ConfigError
    from pipezero.slurm import rank_variables

    env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "5"}
    del env[missing]
    with pytest.raises(ConfigError, match=f"{missing} is not set, but SLURM_STEP_ID and SLURM_PROCID say"):
        rank_variables(env)


def test_a_stall_report_at_or_past_the_timeout_is_refused():
    """The watchdog reports a wait that passed --stall-report; past --timeout the wait has already
    failed, so such a setting would silently never report: refused in one line."""
    from pipezero.errors import ConfigError
    from pipezero.settings import build_config

    with pytest.raises(ConfigError, match="--stall-report 60 is not below --timeout 30"):
        build_config(overrides={"parallel.stall_report_s": 60.0, "parallel.timeout_s": 30.0})
    assert build_config(overrides={"parallel.stall_report_s": 5.0, "parallel.timeout_s": 30.0})


def test_plan_refuses_a_quant_block_it_would_not_use(capsys):
    """As train does: without a --quantize-* flag the block size changes nothing in the plan."""
    argv = ["plan", "--preset", "tiny", "--gpus", "2", "--gpu-memory", "8", "--global-batch", "4", "--seq-len", "64"]
    assert_one_line(*run_main([*argv, "--quant-block", "64"], capsys), "--quant-block 64 prices quantized traffic")
    assert run_main([*argv, "--quant-block", "64", "--quantize-grads", "int8"], capsys)[0] == 0
