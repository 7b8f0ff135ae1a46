"""A --config TOML file pipezero cannot read as settings is one line naming the file, the key and the
fix, exit 2, before anything starts: a folder or binary in its place, a key given the wrong shape, a
setting that only applies beside another. All in this process (the fast lane)."""

from __future__ import annotations

import pytest

from one_line import assert_one_line, run_main


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
