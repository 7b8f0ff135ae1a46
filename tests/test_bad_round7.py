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


@pytest.mark.parametrize("scratch", [".tmp-step-00000002", ".deleting-step-00000001"])
def test_a_link_at_a_checkpoint_scratch_name_is_cleared_not_followed(scratch, tmp_path):
    """A link at checkpoints/.tmp-step-N (a save's scratch) or .deleting-step-N (a prune's) ended
    the save in a traceback (rmtree refuses a link; the mkdir or rename after it failed): the link
    goes, what it points to stays."""
    import torch

    from pipezero.checkpoint.store import Team, committed, write

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    root = tmp_path / "checkpoints"
    write(root, 1, {"x": torch.zeros(4)}, {"run": "this"}, keep=5, team=Team())
    (root / scratch).symlink_to(mine)
    write(root, 2, {"x": torch.ones(4)}, {"run": "this"}, keep=1, team=Team())  # saves 2, prunes 1
    assert [p.name for _, p in committed(root)] == ["step-00000002"]
    assert (mine / "notes.txt").read_text() == "mine"
    assert not (root / scratch).is_symlink()


def test_an_out_through_a_symlink_loop_is_one_line(tmp_path, monkeypatch, capsys):
    """A link on --out's path that loops: a RuntimeError traceback from Path.resolve (train,
    verify: the data-overlap check; export: the inside-a-run check)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    for argv in ([*TRAIN, "--out", "loop/x"], ["export", "nowhere", "--out", "loop/e"], [*VERIFY, "--out", "loop/v"]):
        code, err = run_main(argv, capsys)
        assert_one_line(code, err, "cannot be followed")


@pytest.mark.parametrize("how", ["png", "cache"])
def test_a_tilde_in_png_or_cache_is_refused(how, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    if how == "png":
        argv = ["simulate", "--png", "~/pz-r7.png"]
    else:
        monkeypatch.setenv("PIPEZERO_CACHE", "~/pz-cache")
        (tmp_path / "docs").mkdir()
        (tmp_path / "docs" / "a.txt").write_text("hello " * 200)
        argv = [*TRAIN, "--data", "docs", "--out", "o"]
    code, err = run_main(argv, capsys)
    assert_one_line(code, err, "starts with '~', which only a shell expands")
    assert not (tmp_path / "~").exists()


@pytest.mark.parametrize("text", [b"\x00\xff binary", b"[1, 2]", b'{"rank": "0", "written": 1}'])
def test_a_damaged_flight_record_is_named_not_taken_for_none(text, tmp_path, capsys):
    """`doctor RUN` over rank-*.json files that are garbage, binary or of the wrong types said "no
    flight records" (exit 1), as if no rank had written one (found in review)."""
    from pipezero.doctor import FOLDER

    (tmp_path / FOLDER).mkdir()
    (tmp_path / FOLDER / "rank-00000.json").write_bytes(text)
    assert_one_line(*run_main(["doctor", str(tmp_path)], capsys),
                    "rank-00000.json under " + str(tmp_path / FOLDER) + " are not flight records as pipezero writes")


def test_an_empty_record_folder_is_still_no_records(tmp_path, capsys):
    from pipezero.doctor import FOLDER

    (tmp_path / FOLDER).mkdir()
    code, err = run_main(["doctor", str(tmp_path)], capsys)
    assert code == 1 and "no flight records under" in err
