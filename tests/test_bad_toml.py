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
