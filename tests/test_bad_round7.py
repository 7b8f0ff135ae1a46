"""A seventh review of bad inputs (issue 33), as a careless or hostile user, about what writes
over or deletes the user's files: each case found is one line naming the input and the fix, exit
2, before any process starts, and nothing of the user's touched. All in the fast lane: none
trains."""

from __future__ import annotations

from pathlib import Path

import pytest

from one_line import assert_one_line, run_main

TRAIN = ["train", "--preset", "tiny", "--max-steps", "1", "--no-progress", "--seq-len", "16", "--tokenizer", "bytes",
         "--sample-tokens", "0", "--microbatches", "1", "--micro-batch-size", "1"]
VERIFY = ["verify", "--preset", "tiny", "--steps", "1", "--seq-len", "16", "--tokenizer", "bytes"]


def test_verify_keeps_a_file_of_the_users_in_its_ranks_folder(tmp_path, capsys):
    """verify deleted every OUT/ranks/rank*.pt before the layout ran, the user's rank-notes.pt
    among them: only the rankR.pt files its ranks write are its own."""
    mine = tmp_path / "v" / "ranks" / "rank-notes.pt"
    mine.parent.mkdir(parents=True)
    mine.write_text("mine")
    code, err = run_main([*VERIFY, "--pp", "2", "--nproc", "2", "--out", str(tmp_path / "v")], capsys)
    assert_one_line(code, err, "ranks/ holds 'rank-notes.pt', which verify did not write")
    assert mine.read_text() == "mine"


def test_verify_still_takes_its_own_earlier_rank_files(tmp_path):
    """An earlier verify's ranks/rank3.pt (a larger layout) is verify's own: no refusal."""
    from pipezero.verify import check_out

    (tmp_path / "ranks").mkdir()
    (tmp_path / "ranks" / "rank3.pt").write_bytes(b"")
    check_out(tmp_path)


def test_an_empty_out_beside_the_data_is_named_empty(tmp_path, monkeypatch, capsys):
    """--out '' in the folder holding --data said '--out '' holds --data docs: put --out outside
    the data', a fix that does not apply: the working directory was taken for the empty name."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("hello " * 200)
    monkeypatch.chdir(tmp_path)
    code, err = run_main([*TRAIN, "--data", "docs", "--out", ""], capsys)
    assert_one_line(code, err, "--out is empty")


@pytest.mark.parametrize("how", ["flag", "toml", "export"])
def test_a_tilde_no_shell_expanded_is_refused_not_made_a_folder(how, tmp_path, monkeypatch, capsys):
    """A quoted '~/runs/a', --out=~/x or a TOML value reach pipezero unexpanded: the run (or export)
    went to a new folder named '~' in the working directory, which `rm -r ~` later takes for home."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.toml").write_text('[run]\nout = "~/pz-runs/a"\n')
    argv = {"flag": [*TRAIN, "--out", "~/pz-runs/a"],
            "toml": ["train", "--config", "c.toml", *TRAIN[1:]],
            "export": ["export", "nowhere", "--out", "~/pz-runs/e"]}[how]
    code, err = run_main(argv, capsys)
    assert_one_line(code, err, "starts with '~', which only a shell expands")
    assert str(Path.home() / "pz-runs") in err
    assert not (tmp_path / "~").exists()


def test_a_real_folder_named_tilde_is_the_users_choice(tmp_path, monkeypatch):
    from pipezero.util import unexpanded_home

    monkeypatch.chdir(tmp_path)
    assert unexpanded_home("--out", "~/x") is not None
    (tmp_path / "~").mkdir()
    assert unexpanded_home("--out", "~/x") is None
    assert unexpanded_home("--out", "runs/~x") is None
