"""`pipezero verify`: a correct layout passes, one drifted replica fails and is named."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from one_line import assert_one_line, run_main
from pipezero.cli import main
from pipezero.settings import build_config
from pipezero.config import DType
from pipezero.verify import ROUNDING_FACTOR, TOLERANCES, Check, recut, verdict, within_rounding
from tiny_runs import TINY_FLAGS, VERIFY_TINY, no_launch, write_docs
from user_files import tree

DRIFT = Path(__file__).resolve().parent / "drift"  # a sitecustomize that nudges one rank's weights
SMALL = ["--tokenizer", "bytes", "--seq-len", "32", "--no-progress"]


def verify(capfd: pytest.CaptureFixture[str], text_dir, out, *flags: str) -> tuple[int, str, dict]:
    """`pipezero verify` run from this process (its launcher and ranks are processes of their own, as
    under the console command, without a second interpreter importing torch to start them): its exit
    status, everything it and its ranks printed, and its report."""
    code = main(["verify", "--data", str(text_dir), "--out", str(out), *SMALL, *flags])
    printed = capfd.readouterr()
    return code, printed.out + printed.err, json.loads((out / "verify.json").read_text())


def test_one_process_layout_verifies_in_process(text_dir, tmp_path, capsys):
    assert main(["verify", "--data", str(text_dir), "--out", str(tmp_path), "--steps", "2", *SMALL]) == 0
    report = json.loads((tmp_path / "verify.json").read_text())
    assert report["ok"] and report["transfer_order"]["proven"] and report["steps"] == 2
    assert {c["what"] for c in report["checks"]} == {"loss", "grad_norm", "param"}
    # one process again, its batch of 4 micro-batches of 4 as 2 of 8: every check, within tolerance
    floor = report["rounding_floor"]
    assert floor["cut"] == [2, 8] and {c["what"] for c in floor["checks"]} == {"loss", "grad_norm", "param"}
    assert all(c["error"] <= c["tolerance"] for c in floor["checks"]) and report["within_rounding"] is False
    out = capsys.readouterr().out
    assert "OK" in out and "rounding" in out


@pytest.mark.distributed
@pytest.mark.slow(24)
def test_pipeline_with_tied_ends_on_one_rank_verifies(text_dir, tmp_path, capfd):
    """ZB-V with M < 2P and tied embeddings (both ends on rank 0), AdamW and a micro-batch's activations
    in host memory: exit 0, every tensor compared with one process that offloads nothing."""
    toml = tmp_path / "tied.toml"
    toml.write_text("[model]\ntie_embeddings = true\n")
    code, log, report = verify(capfd, text_dir, tmp_path / "v", "--config", str(toml), "--nproc", "2", "--pp", "2",
                               "--schedule", "zb-v", "--virtual-stages", "2", "--microbatches", "3",
                               "--offload", "optimizer", "--offload-activations", "1")
    assert code == 0, log[-3000:]
    assert "proven free of deadlock" in log and report["ok"] and not report["problems"]
    params = {(c["rank"], c["name"]) for c in report["checks"] if c["what"] == "param"}
    assert {(0, "layers.0.weight"), (0, "layers.3.proj.weight")} <= params  # both tied ends
    steps = [c for c in report["checks"] if c["what"] == "loss"]
    assert len(steps) == 2 * 3 and all(c["error"] <= 1e-5 for c in steps)  # every rank, every step
    reference = json.loads((tmp_path / "v" / "reference" / "config.json").read_text())["parallel"]
    assert (reference["offload"], reference["offload_activations"]) == ("none", 0)


@pytest.mark.distributed
def test_one_drifted_replica_fails_verify_and_is_named(text_dir, tmp_path, capfd, monkeypatch):
    """ZeRO-3 over two replicas; tests/drift/sitecustomize.py nudges replica 1's copy of one weight
    by 1e-3 before verify writes it (a hook kept out of the package, loaded by the ranks)."""
    monkeypatch.setenv("PIPEZERO_TEST_DRIFT", "1:layers.1.attn.wq.weight")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(DRIFT), os.environ.get("PYTHONPATH", "")]))
    code, log, report = verify(capfd, text_dir, tmp_path / "v", "--nproc", "2", "--dp", "2", "--zero", "3",
                               "--microbatches", "2")
    assert code == 1, log[-3000:]
    assert report["failed"] == [report["failed"][0]] and "rank 1 (stage 0, replica 1) layers.1.attn.wq.weight" \
        in report["failed"][0]
    assert "FAILED" in log and "layers.1.attn.wq.weight" in log
    # a 1e-3 nudge is far beyond what one process differs from itself by
    assert report["within_rounding"] is False and "trains another model" in log
    ok = [c for c in report["checks"] if c["rank"] == 0 and c["what"] == "param"]
    assert ok and all(c["ok"] for c in ok)  # the other replica is right


@pytest.mark.parametrize("cut, again", [((4, 2), (2, 4)), ((3, 2), (6, 1)), ((3, 1), (1, 3)), ((1, 1), None)])
def test_the_rounding_floor_recuts_the_same_global_batch(cut, again, tmp_path):
    """Twice the micro-batch, else half, else the whole batch as one; a single sequence can't be re-cut."""
    ref = build_config(None, {"parallel.microbatches": cut[0], "parallel.micro_batch_size": cut[1],
                              "run.out": str(tmp_path / "reference")})
    floor = recut(ref)
    got = None if floor is None else (floor.parallel.microbatches, floor.parallel.micro_batch_size)
    assert got == again
    if floor is not None:
        assert floor.run.out == str(tmp_path / "floor") and floor.optim.lr == ref.optim.lr


def check(what: str, error: float, name: str = "", step: int | None = 1) -> Check:
    return Check(what, step, 1, name, 1.0, 1.0, error, 1e-5)


def test_a_failure_is_called_rounding_only_within_the_factor_of_the_same_check():
    floor = [check("param", 3e-5, "w"), check("loss", 2e-6), check("param", 1e-9, "v")]
    near = [check("param", 8e-5, "w")]  # 2.7x the re-cut run's error of w
    assert within_rounding(near, floor)
    assert not within_rounding([check("param", ROUNDING_FACTOR * 3.1e-5, "w")], floor)
    assert not within_rounding(near + [check("param", 2e-5, "v")], floor)  # v's floor is tiny: a real difference
    assert not within_rounding([check("grad_norm", 6e-5)], floor)  # no such check re-cut
    assert not within_rounding(near, [])  # nothing to compare with
    assert not within_rounding([], floor)  # nothing failed
    tol = TOLERANCES[DType.FP32]
    line = verdict(False, True, tol, [2, 8], 0.1, False)
    assert "lower --lr" in line and "M=2 x 8" in line and "does not show another model" in line
    assert "exceed 10x" in verdict(False, False, tol, [2, 8], 0.1, False)
    assert verdict(False, False, tol, [2, 8], 0.1, True).endswith("trains another model[/red]")  # a lost tensor


@pytest.mark.parametrize("flags", [["--max-steps", "100"], ["--resume"], ["--checkpoint-every", "1"],
                                   ["--keep-checkpoints", "2"], ["--eval-every", "1"], ["--sample-tokens", "10"],
                                   ["--max-restarts", "1"], ["--force"], ["--no-save-final"]])
def test_a_train_flag_verify_would_ignore_is_refused(flags, tmp_path, capsys):
    """verify runs --steps steps, fresh, without checkpoints: these flags changed nothing, exit 0."""
    from one_line import assert_one_line, run_main

    code, err = run_main(["verify", "--out", str(tmp_path / "v"), *SMALL, *flags], capsys)
    assert_one_line(code, err, f"it takes no {flags[0]}: drop it")
    assert not (tmp_path / "v").exists()


@pytest.mark.parametrize("out, needle", [("a-file", "--out 'a-file' is a file: name a folder for verify's runs"),
                                         ("", "--out '' is empty: name a folder for verify's runs")])
def test_verify_out_that_is_a_file_or_empty_is_one_line(out, needle, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("mine")
    assert_one_line(*run_main(["verify", "--preset", "tiny", "--steps", "1", "--out", out], capsys), needle)
    assert (tmp_path / "a-file").read_text() == "mine"


@pytest.mark.parametrize("make, needle", [
    (lambda out: (out / "metrics.jsonl").write_text("{}\n"), "holds 'metrics.jsonl', which verify did not write"),
    (lambda out: (out / "notes.txt").write_text("mine"), "holds 'notes.txt', which verify did not write"),
    (lambda out: (out / "layout").write_text("mine"), "layout is a file, where verify writes a folder"),
    (lambda out: (out / "verify.json").mkdir(), "verify.json is a folder, where verify writes a file"),
])
def test_verify_writes_only_into_a_folder_of_its_own(make, needle, tmp_path, capsys):
    """verify makes layout/, reference/, floor/ in --out: never beside files it did not write."""
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


def test_verify_nproc_that_is_not_the_layout_is_one_line(tmp_path, capsys):
    """--nproc must be the layout's rank count: a one-rank layout would otherwise ignore the flag."""
    assert_one_line(*run_main(["verify", "--nproc", "2", "--preset", "tiny", "--out", str(tmp_path / "v")], capsys),
                    "--nproc 2 but pp x dp = 1; make them equal")
    assert not (tmp_path / "v").exists()


def test_verify_keeps_a_file_of_the_users_in_its_ranks_folder(tmp_path, capsys):
    """verify clears OUT/ranks before the layout runs: only the rankR.pt files its ranks write are its
    own, so a user's rank-notes.pt there is refused, not deleted."""
    mine = tmp_path / "v" / "ranks" / "rank-notes.pt"
    mine.parent.mkdir(parents=True)
    mine.write_text("mine")
    code, err = run_main([*VERIFY_TINY, "--pp", "2", "--nproc", "2", "--out", str(tmp_path / "v")], capsys)
    assert_one_line(code, err, "ranks/ holds 'rank-notes.pt', which verify did not write")
    assert mine.read_text() == "mine"


def test_verify_still_takes_its_own_earlier_rank_files(tmp_path):
    """An earlier verify's ranks/rank3.pt (a larger layout) is verify's own: no refusal."""
    from pipezero.verify import check_out

    (tmp_path / "ranks").mkdir()
    (tmp_path / "ranks" / "rank3.pt").write_bytes(b"")
    check_out(tmp_path)


def test_a_second_verify_at_the_same_out_is_refused(tmp_path, monkeypatch, capsys):
    """Two `pipezero verify` at one --out (say --pp 2 and --dp 2) would delete and read each other's
    ranks/rankR.pt, and call a right layout wrong. verify holds OUT/.lock while it runs; a second
    one is refused in one line."""
    from pipezero.rundir import held

    monkeypatch.chdir(tmp_path)
    write_docs(tmp_path)
    with held(tmp_path / "v"):  # the first verify, running
        code, err = run_main(["verify", "--preset", "tiny", "--steps", "1", "--seq-len", "16", "--tokenizer", "bytes",
                              "--data", "docs", "--out", "v"], capsys)
    assert_one_line(code, err, "--out 'v' is in use by another run (pid")
    assert sorted(p.name for p in (tmp_path / "v").iterdir()) == [".lock"]


def test_verify_takes_a_folder_an_earlier_verify_left(tmp_path):
    """Its own .lock, left by the earlier verify, is verify's: no refusal."""
    from pipezero.rundir import held
    from pipezero.verify import check_out

    with held(tmp_path):
        pass
    assert (tmp_path / ".lock").is_file()
    check_out(tmp_path)


@pytest.mark.parametrize("flag, value", [("--quantize-grads", "int8"), ("--quantize-weights", "int8")])
def test_verify_of_a_quantized_layout_is_refused_before_the_layout_runs(flag, value, tmp_path, monkeypatch, capsys):
    write_docs(tmp_path, 8, "some words to train on, file {i} ", 20)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("pipezero.launch.launch_local", no_launch)
    code, err = run_main(["verify", *TINY_FLAGS, "--data", "docs", "--steps", "1", "--out", "v", "--zero", "3", "--dp", "2",
                          "--nproc", "2", flag, value], capsys)
    assert_one_line(code, err, f"{flag} {value} changes every step's numbers by design")
    assert not (tmp_path / "v").exists()


def test_verify_reference_drops_what_only_data_parallel_traffic_has(tmp_path):
    """--secondary-shard node and --hierarchical are exact: the one-process reference leaves them out
    (kept, its validation would refuse --secondary-shard with --dp 1, after the layout had run)."""
    from pipezero.config import ParallelConfig, SecondaryShard, TrainConfig
    from pipezero.verify import reference_config

    layout = TrainConfig(parallel=ParallelConfig(dp=2, zero=3, secondary_shard=SecondaryShard.NODE, hierarchical=True))
    ref = reference_config(layout, tmp_path)
    assert (ref.parallel.dp, ref.parallel.zero, ref.parallel.secondary_shard, ref.parallel.hierarchical) == \
        (1, 0, SecondaryShard.NONE, False)
    assert layout.parallel.secondary_shard is SecondaryShard.NODE  # the layout itself untouched


def test_verify_never_writes_over_a_run_or_a_report_it_did_not_write(tmp_path):
    """verify's runs go to OUT/layout, reference and floor: a training run of the user's at one of those
    names (no verify report beside it) had its metrics, summary and config replaced, and a user's own
    verify.json was overwritten. An earlier verify's folder (its report beside its runs) is verify's own."""
    from pipezero.errors import ConfigError
    from pipezero.verify import check_out

    out = tmp_path / "exp"
    (out / "layout" / "checkpoints").mkdir(parents=True)
    (out / "layout" / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match="layout/ holds files but no verify report"):
        check_out(out)
    (out / "verify.json").write_text('{"mine": 1}')
    with pytest.raises(ConfigError, match="verify.json is not a report verify wrote"):
        check_out(out)
    (out / "verify.json").write_text('{"layout": "pp=2 dp=2", "steps": 2, "ok": true}')
    check_out(out)  # an earlier verify's: written again
