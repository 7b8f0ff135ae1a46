"""A fresh review of bad inputs (issue 33, round four): the leftovers of round three and the cases
the fourth review found mishandled, each one line naming the input, exit 2, nothing of the user's
touched. One process each, nothing trained (the fast lane), unless marked."""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path

import numpy as np
import pytest

from one_line import assert_one_line, run_main

TRAIN = ["train", "--preset", "tiny", "--max-steps", "1", "--no-progress", "--seq-len", "16"]


class FailingStream(io.StringIO):
    """A standard output that refuses every write, as /dev/full (ENOSPC) or a closed pipe (EPIPE)."""

    def __init__(self, code: int) -> None:
        super().__init__()
        self.code = code

    def write(self, text: str) -> int:
        raise OSError(self.code, os.strerror(self.code))

    def flush(self) -> None:
        raise OSError(self.code, os.strerror(self.code))


@pytest.mark.parametrize("argv", [["simulate", "--json"], ["simulate"], ["plan", "--preset", "tiny", "--gpus", "1", "--global-batch", "1",
                                                                        "--gpu-memory", "80", "--json"]])
def test_a_full_standard_output_is_one_line(argv, capsys, monkeypatch):
    """`plan --json > /dev/full` ended in an OSError traceback."""
    monkeypatch.setattr("sys.stdout", FailingStream(errno.ENOSPC))
    assert_one_line(*run_main(argv, capsys), "cannot write to standard output (No space left on device)")


def test_a_closed_pipe_ends_quietly_as_sigpipe_would(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdout", FailingStream(errno.EPIPE))
    code, err = run_main(["simulate", "--json"], capsys)
    assert (code, err) == (141, "")


def test_a_closed_standard_output_is_refused_where_it_is_the_result(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdout", None)
    assert_one_line(*run_main(["simulate"], capsys), "standard output is closed")


def test_a_full_disk_under_a_commands_own_files_is_not_taken_for_standard_output(tmp_path, capsys, monkeypatch):
    """Only the stream's own failures are output failures: an OSError from a file a command writes
    (here simulate --png's) keeps its own report."""
    from pipezero.telemetry import plot

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(plot, "draw_timeline", full)
    assert_one_line(*run_main(["simulate", "--png", str(tmp_path / "t.png")], capsys),
                    "t.png cannot be written: No space left on device")


def test_a_checkpoint_of_non_finite_weights_is_refused_before_anything_is_written(tmp_path):
    """--lr 1e308: the one update left every weight NaN, saved as the final checkpoint, exit 0."""
    import torch

    from pipezero.checkpoint.pieces import Piece
    from pipezero.checkpoint.state import check_finite, nonfinite_entries
    from pipezero.checkpoint.store import CheckpointError, Team

    shard = torch.zeros(8)
    state = {"model.a": Piece(16, 0, shard[:4]), "model.b": Piece(16, 4, shard[4:]), "step": torch.zeros(2, dtype=torch.long)}
    check_finite(state, Team(step=3), 1e-3)  # finite: nothing said
    shard[5] = float("nan")
    state["optim.exp_avg_sq.c"] = torch.tensor([float("inf")])
    assert nonfinite_entries(state) == ["model.b", "optim.exp_avg_sq.c"]
    with pytest.raises(CheckpointError, match=r"^step 3: checkpoint not saved: model.b, optim.exp_avg_sq.c hold NaN "
                                              r"or inf .*lower --lr \(now 1e\+308\)"):
        check_finite(state, Team(step=3), 1e308)


@pytest.mark.distributed  # trains twice in this process (~5 s)
def test_a_diverged_run_saves_no_checkpoint_and_keeps_the_earlier_ones(tmp_path, capsys):
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 4000, 4000).astype(np.uint16))
    run = tmp_path / "run"
    base = [*TRAIN, "--data", str(tokens), "--out", str(run), "--checkpoint-every", "1", "--sample-tokens", "0",
            "--microbatches", "1", "--micro-batch-size", "1"]
    assert run_main(base, capsys)[0] == 0
    good = run / "checkpoints" / "step-00000001"
    kept = sorted((p.name, p.read_bytes()) for p in good.iterdir())
    code, err = run_main([*base, "--resume", "--max-steps", "3", "--lr", "1e308"], capsys)
    assert code == 1 and err.count("pipezero: error:") == 1, err
    assert "step 2: checkpoint not saved:" in err and "hold NaN or inf" in err, err
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-00000001"]
    assert sorted((p.name, p.read_bytes()) for p in good.iterdir()) == kept


def tree(folder: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under `folder` with size, inode and modification time: nothing written, replaced or removed."""
    return {str(p.relative_to(folder)): (p.lstat().st_size, p.lstat().st_ino, p.lstat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("make, needle", [
    (lambda out: (out / "metrics.jsonl").write_text("{}\n"), "holds 'metrics.jsonl', which verify did not write"),
    (lambda out: (out / "notes.txt").write_text("mine"), "holds 'notes.txt', which verify did not write"),
    (lambda out: (out / "layout").write_text("mine"), "layout is a file, where verify writes a folder"),
    (lambda out: (out / "verify.json").mkdir(), "verify.json is a folder, where verify writes a file"),
])
def test_verify_writes_only_into_a_folder_of_its_own(make, needle, tmp_path, capsys):
    """`verify --out RUN` made layout/, reference/, floor/ beside a run's files."""
    out = tmp_path / "out"
    out.mkdir()
    make(out)
    before = tree(out)
    assert_one_line(*run_main(["verify", "--preset", "tiny", "--seq-len", "16", "--out", str(out)], capsys), needle)
    assert tree(out) == before


@pytest.mark.parametrize("steps, needle", [("100000000000", "--steps = 100000000000: expected an integer >= 1 and <= 1000"),
                                           ("0", "--steps = 0: expected an integer >= 1")])
def test_verify_steps_are_bounded(steps, needle, tmp_path, capsys):
    assert_one_line(*run_main(["verify", "--steps", steps, "--out", str(tmp_path / "v")], capsys), needle)
    assert not (tmp_path / "v").exists()


def test_a_model_setting_beside_model_or_model_spec_is_named_as_the_user_set_it(tmp_path, capsys):
    """'drop model.preset' when the user typed --preset."""
    (tmp_path / "m").mkdir()
    assert_one_line(*run_main(["train", "--model", str(tmp_path / "m"), "--preset", "tiny"], capsys),
                    f"--model {tmp_path / 'm'} fixes the model's shape; drop --preset")
    assert_one_line(*run_main(["train", "--model-spec", "x:y", "--preset", "tiny"], capsys),
                    "--model-spec x:y is the whole model; drop --preset")
    (tmp_path / "p.toml").write_text('[model]\npreset = "tiny"\n')
    assert_one_line(*run_main(["train", "--config", str(tmp_path / "p.toml"), "--model", str(tmp_path / "m")], capsys),
                    f"drop model.preset (in {tmp_path / 'p.toml'})")


@pytest.mark.parametrize("argv, needle", [
    ([*TRAIN, "--data", "{fifo}.npy"], "--data '{fifo}.npy' is a pipe (FIFO), not a file"),  # np.load blocked: a hang
    ([*TRAIN, "--data", "{fifo}"], "--data '{fifo}' is a pipe (FIFO), not a file"),
    ([*TRAIN, "--data", "/dev/zero"], "--data '/dev/zero' is a device, not a file"),
    ([*TRAIN, "--tokenizer", "{fifo}.json"], "tokenizer file '{fifo}.json' is a pipe (FIFO), not a file"),
    ([*TRAIN, "--tokenizer", "{tmp}"], "is a folder; name a tokenizer.json"),
    (["simulate", "--from-trace", "{fifo}"], "--from-trace '{fifo}' is a pipe (FIFO), not a file"),
    (["train", "--model", "{model}"], "config.json is a pipe (FIFO), not a file"),
])
def test_a_pipe_or_device_is_named_as_what_it_is(argv, needle, tmp_path, capsys):
    """A pipe given as a data or model path was reported as "does not exist", or read for ever."""
    fifo = tmp_path / "fifo"
    for name in ("fifo", "fifo.npy", "fifo.json"):
        os.mkfifo(tmp_path / name)
    model = tmp_path / "model"
    model.mkdir()
    os.mkfifo(model / "config.json")
    subst = {"fifo": str(fifo), "model": str(model), "tmp": str(tmp_path / "tok.json")}
    (tmp_path / "tok.json").mkdir()
    argv = [a.format(**subst) for a in argv]
    assert_one_line(*run_main(argv, capsys), needle.format(**subst))


@pytest.mark.parametrize("flags, toml, needle", [
    (["--data", "{npy}", "--on-bad-record", "skip"], "", "--on-bad-record skip applies to documents; --data {npy} is "
                                                         "a token file"),
    (["--data", "{npy}", "--tokenizer", "bytes"], "", "--tokenizer bytes tokenizes nothing: --data {npy} holds token "
                                                      "ids already"),
    (["--data", "{npy}", "--text-field", "body"], "", "--text-field body applies to documents"),
    (["--data", "{npy}", "--max-document-mb", "2"], "", "--max-document-mb 2 applies to documents"),
    (["--on-bad-record", "skip"], "", "--on-bad-record skip applies to --data documents; the built-in corpus"),
    (["--data", "{npy}"], "[data]\nbpe_vocab = 300\n", "data.bpe_vocab (in {toml}) 300 sizes the BPE"),
    (["--tokenizer", "bytes"], "[data]\nbpe_vocab = 300\n", "the tokenizer is bytes"),
    (["--data", "{npy}"], "[data]\nmax_bytes = 3000\n", "data.max_bytes (in {toml}) 3000 cuts the built-in corpus"),
])
def test_a_data_setting_the_source_does_not_read_is_one_line(flags, toml, needle, tmp_path, capsys):
    """Each was accepted and changed nothing, exit 0."""
    npy = tmp_path / "tokens.npy"
    np.save(npy, np.arange(1000, dtype=np.uint16))
    (tmp_path / "run.toml").write_text(toml)
    subst = {"npy": str(npy), "toml": str(tmp_path / "run.toml")}
    argv = [*TRAIN, "--out", str(tmp_path / "out"), *(f.format(**subst) for f in flags)]
    assert_one_line(*run_main([*argv, "--config", subst["toml"]] if toml else argv, capsys), needle.format(**subst))
    assert not (tmp_path / "out").exists()


# --- the fourth review's cases ---------------------------------------------------------------------


@pytest.mark.parametrize("flags, needle", [
    (["--microbatches", "1000000000"], "--pp 1 x --microbatches 1000000000 x --virtual-stages 1 = 1000000000 stage "
                                       "micro-batches a step; the limit is 65536"),  # never started: proving 10^9
    (["--pp", "2", "--microbatches", "40000"], "= 80000 stage micro-batches a step"),
    (["--micro-batch-size", "1000000000"], "= 1000000000 sequences of --seq-len 16 = 16000000000 tokens a step; "
                                           "the limit is 268435456"),  # a 119 GiB allocation's traceback
])
def test_a_step_past_what_a_rank_can_build_or_hold_is_one_line(flags, needle, tmp_path, capsys):
    argv = ["train", "--preset", "tiny", "--max-steps", "1", "--seq-len", "16", "--microbatches", "1",
            "--out", str(tmp_path / "o"), *flags]
    assert_one_line(*run_main(argv, capsys), needle)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv, needle", [
    (["train", "--preset", "7b", "--seq-len", "16"], "GiB (1 CPU rank's predicted peak: weights, gradients, AdamW "
                                                     "state, activations), more than this host's"),
    (["train", "--preset", "70b", "--seq-len", "16", "--pp", "4", "--nproc", "4"], "(4 CPU ranks' predicted peaks"),
])
def test_a_model_past_the_hosts_memory_is_refused_before_it_is_built(argv, needle, tmp_path, capsys, monkeypatch):
    """--preset 7b on a CPU host of 24 GiB was built for minutes, until the kernel killed it. The
    host here is made 16 GiB, as a laptop's, so the test does not depend on this machine's size."""
    real = os.sysconf
    monkeypatch.setattr(os, "sysconf", lambda name: 4 << 20 if name == "SC_PHYS_PAGES" else real(name))
    code, err = run_main([*argv, "--max-steps", "1", "--device", "cpu", "--out", str(tmp_path / "o")], capsys)
    assert_one_line(code, err, needle)
    assert f"this host's {(4 << 20) * real('SC_PAGE_SIZE') / 2**30:.1f} GiB" in err
    assert not (tmp_path / "o").exists()


def test_a_tiny_heldout_fraction_holds_out_nothing_instead_of_overflowing():
    """--heldout-fraction 1e-320: 1 / x is inf, round(inf) an OverflowError traceback."""
    from pipezero.data.corpus import every_kth, split_documents

    assert every_kth(0.25) == 4 and every_kth(1e-320) == 2**62
    train, held = split_documents(["a\n" * 50] * 3, 1e-320)
    assert train and held  # fewer documents than k: the tail of the text is held out


def test_an_empty_data_path_list_is_refused_not_the_built_in_corpus(tmp_path, capsys):
    (tmp_path / "run.toml").write_text("[data]\npath = []\n")
    assert_one_line(*run_main([*TRAIN, "--config", str(tmp_path / "run.toml"), "--out", str(tmp_path / "o")], capsys),
                    "data.path = []: name document files")
    assert not (tmp_path / "o").exists()


def test_rope_settings_given_twice_that_differ_are_refused(tmp_path):
    """transformers 5 reads rope_scaling and rope_theta over rope_parameters: a yarn scaling added
    beside rope_parameters trained default rope silently, another model than transformers loads."""
    from pipezero.errors import ConfigError
    from pipezero.models.hf import _rope

    base = {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    assert _rope(base, tmp_path) == (500000.0, None)
    assert _rope({**base, "rope_theta": 500000.0}, tmp_path) == (500000.0, None)  # the same, twice: fine
    for extra, needle in (({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "in rope_scaling (rope_type)"),
                          ({"rope_scaling": {"type": "yarn"}}, "in rope_scaling (rope_type)"),
                          ({"rope_theta": "big"}, "in rope_theta (rope_theta)"),
                          ({"rope_theta": 10000.0}, "in rope_theta")):
        with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            _rope({**base, **extra}, tmp_path)


def test_verify_nproc_that_is_not_the_layout_is_one_line(tmp_path, capsys):
    """verify --nproc 2 of a one-rank layout trained one process, exit 0, the flag ignored."""
    assert_one_line(*run_main(["verify", "--nproc", "2", "--preset", "tiny", "--out", str(tmp_path / "v")], capsys),
                    "--nproc 2 but pp x dp = 1; make them equal")
    assert not (tmp_path / "v").exists()


@pytest.mark.parametrize("argv", [[*TRAIN, "--out", "{long}"], [*TRAIN, "--data", "{long}.txt"],
                                  ["simulate", "--png", "{long}.png"], ["export", "{long}", "--out", "e"]])
def test_a_name_too_long_for_the_filesystem_is_one_line(argv, tmp_path, capsys, monkeypatch):
    """An OSError (File name too long) traceback from the first Path.exists that met it."""
    monkeypatch.chdir(tmp_path)
    long = "x" * 300
    code, err = run_main([a.format(long=long) for a in argv], capsys)
    assert_one_line(code, err, "characters)' is too long for this filesystem (File name too long)")


def test_doctor_of_a_folder_that_is_not_there_or_a_file_is_one_line(tmp_path, capsys):
    """Both were 'no flight records under X/doctor', exit 1, sending the user to look for records."""
    (tmp_path / "f").write_text("x")
    assert_one_line(*run_main(["doctor", str(tmp_path / "nowhere")], capsys), "nowhere does not exist: pass the run's")
    assert_one_line(*run_main(["doctor", str(tmp_path / "f")], capsys), "f is not a folder: pass the run's folder")


@pytest.mark.parametrize("sizes, needle", [
    ({"pp": 1_000_000_000}, "past what train runs"),  # lowered programs for ever
    ({"microbatches": 1_000_000_000}, "past what train runs"),
    ({"dp": 0}, "positive integers only"),
    ({"pp": "2"}, "positive integers only"),
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


@pytest.mark.parametrize("env, needle", [
    ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR='' MASTER_PORT='' name no rendezvous"),  # a ValueError traceback
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "http"}, "MASTER_PORT='http' name no"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "70000"}, "MASTER_PORT='70000' name no"),
])
def test_rank_variables_by_hand_need_a_rendezvous(env, needle):
    from pipezero.errors import ConfigError
    from pipezero.launch import check_rank_variables

    with pytest.raises(ConfigError, match=needle):
        check_rank_variables(env)
    check_rank_variables({"RANK": "0", "WORLD_SIZE": "1"})  # one rank: no rendezvous to name
    check_rank_variables({**env, "MASTER_ADDR": "h", "MASTER_PORT": "29500"})


def test_a_leftover_torchelastic_restart_count_is_one_line(tmp_path, capsys, monkeypatch):
    """Read as an integer by the claim and the resume: 'x' was a ValueError traceback."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "x")
    assert_one_line(*run_main([*TRAIN, "--out", str(tmp_path / "o")], capsys),
                    "TORCHELASTIC_RESTART_COUNT='x' is not a count")
    assert not (tmp_path / "o").exists()


def test_a_rendezvous_that_cannot_connect_is_one_line(capsys, monkeypatch):
    """A MASTER_ADDR that resolves nowhere: a DistNetworkError traceback after --timeout."""
    import torch.distributed as dist

    from pipezero import engine
    from pipezero.cli import train_here

    def unreachable(cfg):
        raise dist.DistNetworkError("The client socket has timed out after 5000ms while trying to connect to (x, 1).")

    monkeypatch.setattr(engine, "train", unreachable)
    monkeypatch.setenv("MASTER_ADDR", "no.such.host")
    monkeypatch.setenv("MASTER_PORT", "29999")
    assert train_here(None) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "connection to no.such.host:29999 failed (DistNetworkError: The client" in err


@pytest.mark.parametrize("argv, needle", [
    ([*TRAIN, "--tokenizer", "gpt2"], "--tokenizer (data.tokenizer) 'gpt2': use 'bpe', 'bytes' or a tokenizer.json"),
    (["train", "--config", "{toml}"], "model.spec (in {toml}) x:y is the whole model; drop model.pretrained (in {toml})"),
])
def test_a_setting_is_named_as_the_user_gave_it(argv, needle, tmp_path, capsys):
    """'data.tokenizer=...' for --tokenizer; '--model-spec' for a spec the TOML file named."""
    toml = tmp_path / "c.toml"
    toml.write_text('[model]\nspec = "x:y"\npretrained = "m"\n')
    assert_one_line(*run_main([a.format(toml=toml) for a in argv], capsys), needle.format(toml=toml))
