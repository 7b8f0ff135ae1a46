"""A --config TOML file pipezero cannot read as settings is one line naming the file, the key and the
fix, exit 2, before anything starts: a folder or binary in its place, a key given the wrong shape, a
setting that only applies beside another. All in this process (the fast lane)."""

from __future__ import annotations

import pytest

from one_line import assert_one_line, run_main
from tiny_runs import TRAIN_TINY_BYTES


def test_a_config_file_that_is_a_folder_or_not_text_is_one_line(tmp_path, capsys):
    (tmp_path / "dir.toml").mkdir()
    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe\x00")
    assert_one_line(*run_main(["train", "--config", str(tmp_path / "dir.toml")], capsys),
                    "dir.toml' is a folder; name a .toml file")
    assert_one_line(*run_main(["train", "--config", str(tmp_path / "bin.toml")], capsys),
                    "bin.toml' is not valid TOML: 'utf-8' codec can't decode byte 0xff")


def test_quant_block_from_toml_alone_is_named_by_its_key(tmp_path, capsys):
    (tmp_path / "run.toml").write_text("[parallel]\nquant_block = 64\n")
    assert_one_line(*run_main(["train", "--config", str(tmp_path / "run.toml")], capsys),
                    "parallel.quant_block 64 applies with --quantize-weights or --quantize-grads")


@pytest.mark.parametrize("text, needle", [
    ("model = 1\n", "model = 1 is a value, not a table: write [model] on a line of its own, its keys under it"),
    ("[[model]]\ndim = 3\n", "[[model]] is an array of tables: write [model], once"),
    ("foo = 1\n", "unknown table [foo]; use one of model"),
    ("max_steps = 5\n", "max_steps = 5 is a key of [run], written outside it: put max_steps = ... on a line under [run]"),
    ("[head_dim]\n", "[head_dim] is a key of [model], written outside it"),
])
def test_a_section_that_is_not_a_table_is_named_as_what_it_is(text, needle, tmp_path, capsys):
    """`model = 1` is named as a value where a table belongs, not as an unknown table."""
    (tmp_path / "c.toml").write_text(text)
    assert_one_line(*run_main([*TRAIN_TINY_BYTES, "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "o")], capsys),
                    needle)


def test_a_toml_file_with_a_byte_order_mark_is_read(tmp_path):
    """Saved by an editor that writes a BOM, which tomllib refuses ("Invalid statement (at line 1,
    column 1)"): the mark is no setting, so it is skipped."""
    from pipezero.settings import build_config

    (tmp_path / "c.toml").write_text("\ufeff[run]\nseed = 7\n", encoding="utf-8")
    assert build_config(str(tmp_path / "c.toml")).run.seed == 7


@pytest.mark.parametrize("text, needle", [
    ("[model]\nhead_dim = 7\n", "model.head_dim = 7 must be even for rotary positions"),
    ("[model]\nrope_llama3 = [8, 4, 1, 8192]\n", "model.rope_llama3: its low_freq_factor 4 must be below its "
                                                  "high_freq_factor 1"),
    ("[model]\nrope_llama3 = [8, 2, 2, 8192]\n", "its low_freq_factor 2 must be below its high_freq_factor 2"),
    ("[model]\nrope_llama3 = [8, 0, 4, 8192]\n", "model.rope_llama3 = [8, 0, 4, 8192]: expected a list of numbers, "
                                                  "each > 0"),
])
def test_a_model_key_is_named_for_what_is_wrong_with_it(text, needle, tmp_path, capsys):
    """An explicit head_dim named as itself (not dim / n_heads); Llama 3 factors whose blend band is
    empty or reversed refused (rotary.py divides by high - low), and a list naming its bound."""
    (tmp_path / "c.toml").write_text(text)
    assert_one_line(*run_main([*TRAIN_TINY_BYTES, "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "o")],
                              capsys), needle)


def test_run_out_from_toml_is_named_as_its_key(tmp_path, capsys):
    """An empty or dangling run.out of the file is named as the file's key, not as a --out never typed."""
    (tmp_path / "empty.toml").write_text('[run]\nout = ""\n')
    assert_one_line(*run_main([*TRAIN_TINY_BYTES, "--config", str(tmp_path / "empty.toml")], capsys),
                    f"run.out (in {tmp_path / 'empty.toml'}) is empty")
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    (tmp_path / "link.toml").write_text(f'[run]\nout = "{tmp_path / "gone"}"\n')
    assert_one_line(*run_main([*TRAIN_TINY_BYTES, "--config", str(tmp_path / "link.toml")], capsys),
                    f"is a symlink to {tmp_path / 'nowhere'}, which does not exist: create that folder, remove the "
                    f"link, or choose another run.out")
    assert not (tmp_path / "nowhere").exists()
