"""An eleventh review of bad inputs (issue 33), as a careless or hostile user: what it found.
--secondary-shard node on one node (`--nproc 2`) was refused by each rank after torchrun started
them (the line twice, torchrun's report, exit 1); verify of a quantized layout ran the layout, then
refused its own one-process reference for `--dp 1` with the layout's --quantize-* flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from one_line import assert_one_line, run_main

TINY = ["--preset", "tiny", "--tokenizer", "bytes", "--seq-len", "16", "--microbatches", "1", "--micro-batch-size", "1"]


def docs(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    for i in range(8):
        (tmp_path / "docs" / f"{i}.txt").write_text(f"some words to train on, file {i} " * 20)


def no_launch(*args, **kwargs):
    raise AssertionError("a rank was started")


def test_secondary_split_problem_names_one_node_and_uneven_nodes():
    from pipezero.config import ParallelConfig, SecondaryShard
    from pipezero.stage import secondary_split_problem

    node = SecondaryShard.NODE
    one_node = secondary_split_problem(ParallelConfig(dp=2, zero=3, secondary_shard=node), 2)
    assert one_node is not None and "on one node" in one_node and "drop it on one node" in one_node
    assert "ranks a node (" not in one_node
    lone = secondary_split_problem(ParallelConfig(dp=4, zero=3, secondary_shard=node), 1)  # a rank a node
    assert lone is not None and "(ranks a node, nodes) [(1, 4)]" in lone
    assert secondary_split_problem(ParallelConfig(dp=4, zero=3, secondary_shard=node), 2) is None
    assert secondary_split_problem(ParallelConfig(dp=2, zero=3), 2) is None


def test_secondary_shard_on_one_node_is_refused_before_torchrun(tmp_path, monkeypatch, capsys):
    docs(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PIPEZERO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("pipezero.launch.launch_local", no_launch)
    code, err = run_main(["train", *TINY, "--data", "docs", "--max-steps", "1", "--no-progress", "--out", "o",
                          "--zero", "3", "--dp", "2", "--nproc", "2", "--secondary-shard", "node"], capsys)
    assert_one_line(code, err, "--secondary-shard node with every replica of a stage on one node")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("flag, value", [("--quantize-grads", "int8"), ("--quantize-weights", "int8")])
def test_verify_of_a_quantized_layout_is_refused_before_the_layout_runs(flag, value, tmp_path, monkeypatch, capsys):
    docs(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("pipezero.launch.launch_local", no_launch)
    code, err = run_main(["verify", *TINY, "--data", "docs", "--steps", "1", "--out", "v", "--zero", "3", "--dp", "2",
                          "--nproc", "2", flag, value], capsys)
    assert_one_line(code, err, f"{flag} {value} changes every step's numbers by design")
    assert not (tmp_path / "v").exists()


def test_verify_reference_drops_what_only_data_parallel_traffic_has(tmp_path):
    """--secondary-shard node and --hierarchical are exact: the one-process reference leaves them out
    (kept, its validation refused --secondary-shard with --dp 1 after the layout had run)."""
    from pipezero.config import ParallelConfig, SecondaryShard, TrainConfig
    from pipezero.verify import reference_config

    layout = TrainConfig(parallel=ParallelConfig(dp=2, zero=3, secondary_shard=SecondaryShard.NODE, hierarchical=True))
    ref = reference_config(layout, tmp_path)
    assert (ref.parallel.dp, ref.parallel.zero, ref.parallel.secondary_shard, ref.parallel.hierarchical) == \
        (1, 0, SecondaryShard.NONE, False)
    assert layout.parallel.secondary_shard is SecondaryShard.NODE  # the layout itself untouched


@pytest.mark.parametrize("extra", [["--zero3-layerwise"], ["--zero3-prefetch", "2"], ["--zero3-prefetch-chunk"]])
@pytest.mark.parametrize("zero", ["0", "1", "2"])
def test_simulate_refuses_zero3_flags_under_another_stage(zero, extra, capsys):
    """simulate --zero 1 --zero3-prefetch-chunk played ZeRO-1 and exited 0, the flag unread (round eleven)."""
    code, err = run_main(["simulate", "--zero", zero, "--dp", "2", *extra, "--json"], capsys)
    assert_one_line(code, err, f"{extra[0]} is read only by ZeRO-3")


@pytest.mark.parametrize("flags", [["--zero3-layerwise", "--zero3-prefetch", "2"], ["--zero3-prefetch-chunk"]])
def test_simulate_takes_zero3_flags_with_zero3(flags, capsys):
    """Each where its layout reads it: the depth layer by layer, the chunk what-if kept gathered."""
    assert run_main(["simulate", "--zero", "3", "--dp", "2", *flags, "--json"], capsys)[0] == 0


@pytest.mark.parametrize("cache", ["docs/cache", "docs", "docs/a/b"])
def test_a_cache_folder_inside_the_data_is_refused(cache, tmp_path, monkeypatch, capsys):
    """PIPEZERO_CACHE=docs/cache with --data docs: the first run trained, every later one read the
    cached tokenizer's json as a document and stopped at its missing 'text' field (round eleven)."""
    docs(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PIPEZERO_CACHE", cache)
    code, err = run_main(["train", *TINY, "--data", "docs", "--max-steps", "1", "--no-progress", "--out", "o"], capsys)
    assert_one_line(code, err, f"the cache folder {cache} (PIPEZERO_CACHE) is inside --data 'docs'")
    assert not (tmp_path / "o").exists()


def test_a_cache_folder_beside_the_data_or_holding_it_is_fine(tmp_path, monkeypatch):
    from pipezero.data.sources import check_cache_out_of_reach

    docs(tmp_path)
    monkeypatch.setenv("PIPEZERO_CACHE", str(tmp_path / "docs-cache"))  # a prefix of the name, not a folder above
    check_cache_out_of_reach([str(tmp_path / "docs"), str(tmp_path / "docs" / "0.txt")])
    monkeypatch.setenv("PIPEZERO_CACHE", str(tmp_path))  # the data inside the cache: the cache's files are not read
    check_cache_out_of_reach([str(tmp_path / "docs")])


def test_the_loopback_store_leaves_no_python_socket_to_be_collected_unclosed():
    """The listening socket was kept as a Python object beside the store that served its
    descriptor: collected, it warned ResourceWarning ('Exception ignored' tracebacks from torchrun's
    agent under PYTHONWARNINGS=error, exit 0; round eleven). The store owns the descriptor now."""
    import gc
    import warnings
    from datetime import timedelta

    from pipezero.loopback import LoopbackTCPStore

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        store = LoopbackTCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=5), wait_for_workers=False)
        store.set("k", "v")
        assert store.get("k") == b"v"
        del store
        gc.collect()
    assert not [w for w in seen if issubclass(w.category, ResourceWarning)], [str(w.message) for w in seen]
