"""A tenth review of bad inputs (issue 33), as a careless or hostile user: what it found. A
--model-spec whose build_layer raises, returns no module, or whose layer_param_counts is not one
count a layer was a traceback from pipezero's own set-up (or a loss on the wrong layer's output)
after the run folder was made; now one line, exit 2, before anything is made."""

from __future__ import annotations

import pytest

OWN = ("import sys\nsys.path.insert(0, {examples!r})\nfrom own_model import GPTSpec\n"
       "class S(GPTSpec):\n")


@pytest.mark.parametrize("body, needle", [
    ("    def build_layer(self, i):\n        raise ValueError('no layer %d' % i)\n",
     "raised ValueError: no layer 0 at {f}:6"),
    ("    def build_layer(self, i):\n        return None\n",
     "S.build_layer(0) gives a NoneType, not a torch.nn.Module"),
    ("    def layer_param_counts(self):\n        return [1]\n",
     "S.layer_param_counts() gives 1 counts; it must give one a layer, n_layers + 2 = 6"),
    ("    def layer_param_counts(self):\n        return [1, 2, -3, 4, 5, 6]\n",
     "S.layer_param_counts() gives [1, 2, -3, 4, 5, 6]; it must give one integer >= 0 a layer"),
])
def test_a_spec_whose_layers_cannot_be_built_is_one_line_before_anything_is_made(body, needle, tmp_path, monkeypatch,
                                                                                  capsys):
    from pathlib import Path

    from one_line import assert_one_line, run_main

    examples = str(Path(__file__).resolve().parent.parent / "examples")
    name = f"spec_layers_{abs(hash(body))}"
    path = tmp_path / f"{name}.py"
    path.write_text(OWN.format(examples=examples) + body)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("some words to train on " * 20)
    monkeypatch.chdir(tmp_path)
    code, err = run_main(["train", "--model-spec", f"{name}:S", "--tokenizer", "bytes", "--packing", "concat",
                          "--data", "docs", "--seq-len", "16", "--max-steps", "1", "--no-progress", "--out", "o"],
                         capsys)
    assert_one_line(code, err, needle.format(f=path))
    assert not (tmp_path / "o").exists()


def test_rope_scaling_that_lacks_keys_rope_parameters_has_is_refused(tmp_path):
    """transformers 5 reads rope_scaling over rope_parameters: one naming llama3 with only its factor,
    beside a complete rope_parameters, is a config transformers refuses (low/high_freq_factor missing)
    that pipezero trained, exit 0, from rope_parameters alone (round ten)."""
    from pipezero.errors import ConfigError
    from pipezero.models.hf import _rope

    full = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16, "rope_theta": 10000.0}
    base = {"rope_parameters": full}
    assert _rope({**base, "rope_scaling": {k: v for k, v in full.items() if k != "rope_theta"}}, tmp_path)[1] == \
        [8.0, 1.0, 4.0, 16.0]  # the same settings twice (rope_theta in rope_parameters only): fine
    with pytest.raises(ConfigError, match=r"in rope_scaling \(low_freq_factor\)"):
        _rope({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, tmp_path)


def test_torchrun_ending_on_a_failed_rank_is_one_line_not_its_traceback(monkeypatch, capsys):
    """A rank that failed (a collective timed out on a slow `pipezero cluster --link`, a spec's forward
    raised) said why in its own line; then torchrun's agent added a ChildFailedError traceback of ~50
    lines, one a node (round ten). Now one line naming the rank and its exit code, exit 1."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from pipezero import loopback

    def failing(argv):
        raise ChildFailedError("pipezero.cli", {1: ProcessFailure(local_rank=1, pid=4242, exitcode=1, error_file=""),
                                                0: ProcessFailure(local_rank=0, pid=4241, exitcode=-15, error_file="")})

    monkeypatch.setattr(loopback, "torchrun_main", failing)
    with pytest.raises(SystemExit) as e:
        loopback.main(["-m", "pipezero.cli"])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "pipezero: rank 0 (exit code -15), 1 (exit code 1) ended the job; each rank's own lines above say why"]


def test_the_emulated_cluster_starts_torchrun_through_the_wrapper_that_ends_quietly():
    from pipezero.cluster import ClusterSpec, EmulatedCluster

    seen = []
    cluster = EmulatedCluster.__new__(EmulatedCluster)
    cluster.spec = ClusterSpec(nodes=2, link="100mbit")
    cluster.address = lambda i: f"10.0.0.{i + 1}"
    cluster.start = lambda node, cmd, env, **kw: seen.append(cmd)
    cluster.torchrun(0, 1, 29500, ["-m", "pipezero.cli", "train"])
    assert seen[0][1:3] == ["-m", "pipezero.loopback"]


def test_ctrl_c_while_torch_is_still_being_imported_is_the_interrupt_line(monkeypatch, capsys):
    """Ctrl-C a second after `pipezero train` started (SIGINT at 1 s, under load) landed in the
    import of torch that building the parser does, before main's handler: a KeyboardInterrupt
    traceback of some 30 lines (round ten; round nine's x-sigint-1s-then-resume met it unseen)."""
    from pipezero import cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["train"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == [cli.INTERRUPTED]


@pytest.mark.parametrize("extra", [["--zero", "2", "--zero3-prefetch", "2"], ["--zero3-prefetch", "3"]])
def test_zero3_prefetch_without_zero3_is_one_line(extra, tmp_path, capsys):
    """--zero3-prefetch 2 with --zero 2 trained, exit 0, the flag read by nothing and nothing said,
    while an unread --link-gbps or --tflops is refused (round ten)."""
    from one_line import assert_one_line, run_main

    code, err = run_main(["train", "--preset", "tiny", "--tokenizer", "bytes", "--max-steps", "1", *extra,
                          "--out", str(tmp_path / "o")], capsys)
    assert_one_line(code, err, f"--zero3-prefetch {extra[-1]} is read only by ZeRO-3")
    assert not (tmp_path / "o").exists()
