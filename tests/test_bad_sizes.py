"""plan and simulate answer any request in seconds: a size they cannot play is one line, exit 2."""

from __future__ import annotations

import time

import pytest

from one_line import assert_one_line, run_main


@pytest.mark.parametrize("argv, needle", [
    # nothing splits 100000 GPUs (pp <= 80 layers, dp dividing 1024): a StopIteration traceback before
    (["plan", "--preset", "70b", "--gpus", "100000", "--gpu-memory", "80"], "choose --gpus 81920 or another"),
    # a scan down from 2^30 GPU counts ran for minutes
    (["plan", "--preset", "tiny", "--gpus", "1073741824", "--gpu-memory", "80"], "choose --gpus 2048 or another"),
    # 40 million cells grew past 3.5 GB before a MemoryError
    (["simulate", "--pp", "4", "--microbatches", "10000000"], "choose --microbatches 16384 or fewer"),
    (["simulate", "--pp", "1000000", "--microbatches", "4"], "choose --pp 256 or fewer"),
    (["simulate", "--schedule", "zb-v", "--pp", "256", "--microbatches", "256"], "131,072 cells"),
    # each finite, their sum per step overflowed: a table of inf times and nan% bubbles, exit 0
    (["simulate", "--cost", "1e308:1e308:1"], "at most 1e+06"),
])
def test_an_unplayable_size_is_one_line_at_once(argv, needle, capsys):
    t0 = time.monotonic()
    assert_one_line(*run_main(argv, capsys), needle)
    assert time.monotonic() - t0 < 5


def test_compare_skips_the_schedules_too_large_to_simulate(monkeypatch):
    """Under --compare a schedule past the bound is skipped with the reason, the others are played:
    at P=2, M=6 and a bound of 16 cells, the V=1 schedules (12 cells) fit and the V=2 ones (24) do not."""
    import argparse

    from pipezero.sim import commands

    monkeypatch.setattr(commands, "MAX_CELLS", 16)
    args = argparse.Namespace(compare=True, schedule="1f1b", pp=2, microbatches=6, virtual_stages=None)
    skipped: dict[str, str] = {}
    played = list(commands.each_schedule(args, skipped))
    assert skipped and all("24 cells" in why for why in skipped.values()), skipped
    assert set(skipped) == {"interleaved-1f1b", "looped-bfs", "zb-v", "dualpipe-v", "v-half"}
    assert len(played) == 4
