"""A twelfth review of bad inputs (issue 33), as a careless or hostile user: what it found.
simulate --zero 0 --quantize-weights int8 played ZeRO-0 unquantized and exited 0 (train refuses the
same layout: ZeRO-0 gathers no weights). Of the three it left to decide: `--hierarchical` with `--dp 1`
was accepted and unread (now refused), and a config.json with fewer layers than its weights trained
the first blocks without a word (now a warning saying so); `plan --gpus 8 --node-size 16` pricing
one part-filled node stays as it is (8 GPUs of a 16-GPU node is a machine one can have)."""

from __future__ import annotations

import pytest

from one_line import assert_one_line, run_main


def test_simulate_refuses_quantized_weights_under_zero0(capsys):
    """round twelve: exit 0, the flag unread (ZeRO-0 has no parameter gather to quantize)."""
    code, err = run_main(["simulate", "--zero", "0", "--dp", "2", "--quantize-weights", "int8", "--json"], capsys)
    assert_one_line(code, err, "--quantize-weights int8 with --zero 0: ZeRO-0 gathers no weights")


@pytest.mark.parametrize("zero", ["1", "2", "3"])
def test_simulate_takes_quantized_weights_where_weights_are_gathered(zero, capsys):
    assert run_main(["simulate", "--zero", zero, "--dp", "2", "--quantize-weights", "int8", "--json"], capsys)[0] == 0


def test_simulate_takes_quantized_grads_under_zero0(capsys):
    assert run_main(["simulate", "--zero", "0", "--dp", "2", "--quantize-grads", "int8", "--json"], capsys)[0] == 0


@pytest.mark.distributed
def test_a_stopped_job_says_what_its_command_leaves(tmp_path, capsys):
    """Ctrl-C under `verify --nproc 2` said "the newest complete checkpoint ... continue with --resume",
    train's line: verify writes no checkpoint and refuses --resume (round twelve). The launcher's
    stop line takes the command's own words; train's stay the default."""
    import signal
    import sys

    from pipezero.job import run_job

    cmd = [sys.executable, "-c", "import os, signal, time; os.kill(os.getppid(), signal.SIGINT); time.sleep(30)"]
    assert run_job(cmd, {}, str(tmp_path), after_stop="verify stopped: run it again") == 128 + signal.SIGINT
    assert capsys.readouterr().err.strip().endswith("every rank ended, verify stopped: run it again")
    assert run_job(cmd, {}, str(tmp_path)) == 128 + signal.SIGINT
    assert "continue with --resume" in capsys.readouterr().err


def test_hierarchical_with_one_replica_is_refused(tmp_path, capsys):
    code, err = run_main(["train", "--hierarchical", "--max-steps", "1", "--out", str(tmp_path / "o")], capsys)
    assert_one_line(code, err, "--hierarchical with --dp 1: there are no data-parallel reductions to split by node")
    assert not (tmp_path / "o").exists()


def test_weights_with_more_blocks_than_config_json_train_the_first_with_a_warning(tmp_path, capsys):
    """transformers warns of the weights it leaves unread; pipezero said nothing (round twelve)."""
    import json

    from hf_models import make_model

    folder = make_model(tmp_path / "m", "llama")
    cfg = json.loads((folder / "config.json").read_text())
    held = cfg["num_hidden_layers"]
    (folder / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": held - 1}))
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(12):
        (docs / f"{i}.txt").write_text(f"some words to train on, {i} " * 20)
    code, err = run_main(["train", "--model", str(folder), "--data", str(docs), "--seq-len", "16", "--max-steps", "1",
                          "--no-progress", "--out", str(tmp_path / "o")], capsys)
    assert code == 0, err
    assert f"num_hidden_layers = {held - 1}, but the weights hold {held} blocks: the run trains blocks 0-{held - 2}" in err
