"""Every user mistake is one line on stderr naming the fix, exit status 2, and no traceback.

Every case runs `pipezero.cli.main` in this process (fast: no interpreter or torch start-up a
case); a `--nproc` case replaces the launcher with one that fails the test, so what it refuses is
refused before torchrun or any rank would start.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from one_line import DEEP, assert_one_line, run_main
from tiny_runs import TINY_FLAGS, TRAIN_TINY, TRAIN_TINY_SMALLEST, no_launch, write_docs


def toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


# (TOML text or None, extra flags, what the one line must say)
CONFIG_CASES = [
    ('[parallel]\npp = "2"\n', [], 'parallel.pp = "2": expected an integer >= 1'),
    ("[parallel]\nzero = 5\n", [], "parallel.zero = 5: expected an integer >= 0 and <= 3"),
    ('[parallel]\nschedule = "1f2b"\n', [], "parallel.schedule = \"1f2b\": expected one of gpipe, 1f1b"),
    ('[model]\ntie_embeddings = "false"\n', [], 'model.tie_embeddings = "false": expected true or false'),
    ("[run]\nmax_steps = 2.5\n", [], "run.max_steps = 2.5: expected an integer >= 1"),
    ("[data]\nseq_len = 64.0\n", [], "data.seq_len = 64.0: expected an integer >= 1"),
    ("[model]\nn_heads = 0\n", [], "model.n_heads = 0: expected an integer >= 1"),
    ("[model]\ndim = -128\n", [], "model.dim = -128: expected an integer >= 1"),
    ("[data]\nmax_bytes = -5\n", [], "data.max_bytes = -5: expected an integer >= 1"),
    ("[run]\nbogus = 1\n", [], "unknown setting 'run.bogus'; [run] accepts max_steps"),
    ("[weird]\nx = 1\n", [], "unknown table [weird]"),
    ("[model\n", [], "is not valid TOML"),
    ("[optim]\nlr = 0.001\nmin_lr = 0.01\n", [], "optim.min_lr = 0.01: expected a number <= optim.lr"),
    ("[optim]\nbeta2 = 1.0\n", [], "optim.beta2 = 1.0: expected a number >= 0 and < 1"),
    ("[run]\ntrace_steps = 0\n", [], "run.trace_steps = 0: expected an integer >= 1"),
    ("[parallel]\nstage_layers = [0, 2, 2]\npp = 3\n", [], "the first chunk must hold the embedding"),
    (None, ["--zero", "5"], "--zero 5: expected an integer >= 0 and <= 3"),
    (None, ["--hierarchical", "--device", "cuda"], "--hierarchical is for gloo (CPU ranks)"),
    ("[parallel]\nranks_per_node = 3\ndp = 4\nhierarchical = true\n", [], "ranks_per_node = 3 does not divide the 4 ranks"),
    (None, ["--schedule", "1f2b"], "--schedule 1f2b: expected one of gpipe"),
    (None, ["--max-steps", "2.5"], "--max-steps 2.5: expected an integer >= 1"),
    (None, ["--seq-len", "64.0"], "--seq-len 64.0: expected an integer >= 1"),
    (None, ["--threads", "-1"], "--threads -1: expected an integer >= 1"),
    # OpenMP could not start 100000 threads: the interpreter died of SIGSEGV, no message
    (None, ["--threads", "100000"], "--threads 100000: expected an integer >= 1 and <= 1024"),
    # with data enough, the launcher would have started 100000 ranks (each importing torch)
    (None, ["--nproc", "100000", "--dp", "100000"], "--nproc 100000: expected an integer >= 1 and <= 256"),
    # torch's generators: "Overflow when unpacking long long", a traceback
    (None, ["--seed", "18446744073709551616"], "--seed 18446744073709551616: expected an integer >= 0 and <= "
                                               "4294967295"),
    # generated a token a whole forward, 1e11 times
    (None, ["--sample-tokens", "100000000000"], "--sample-tokens 100000000000: expected an integer >= 0 and <= 4096"),
    # every rank padded its buckets to a block of 10^12 elements: an allocation of 4 TB, a traceback a rank
    (None, ["--quant-block", "1000000000000"], "--quant-block 1000000000000: expected an integer >= 1 and <= 1048576"),
    # each rank's process group timeout overflowed a timedelta
    (None, ["--timeout", "1e300"], "--timeout 1e300: expected a number >= 1 and <= 604800"),
    (None, ["--max-restarts", "-1"], "--max-restarts -1: expected an integer >= 0"),
    (None, ["--max-restarts", "2"], "--max-restarts 2 needs --nproc > 1"),
    (None, ["--nproc", "0"], "--nproc 0: expected an integer >= 1"),
    (None, ["--nproc", "3", "--dp", "2"], "--nproc 3 but pp x dp = 2; make them equal"),
    (None, ["--lr", "nan"], "--lr nan: expected a finite number > 0"),
    (None, ["--stage-layers", "1,x"], "--stage-layers 1,x: expected a list of integers"),
    (None, ["--bogus"], "unrecognized arguments: --bogus"),
    (None, ["--npr", "2"], "unrecognized arguments: --npr"),  # no abbreviations of flags
    (None, ["--pp"], "argument --pp: expected one argument"),
    (None, ["--config", "/no/such.toml"], "config file '/no/such.toml' does not exist"),
    (None, ["--freeze", "layers.(0"], "--freeze 'layers.(0' is not a valid regular expression"),
    (None, ["--freeze", "lora"], "--freeze 'lora' matches no parameter; names look like layers.0.weight"),
    (None, ["--freeze", "layers"], "--freeze 'layers' matches every parameter, so nothing would train"),
    ('[optim]\nfreeze = "weight$"\n', [], "--freeze 'weight$' matches every parameter"),
]


@pytest.mark.parametrize("text,flags,needle", CONFIG_CASES, ids=[c[2][:40] for c in CONFIG_CASES])
def test_bad_setting_is_one_line(text, flags, needle, tmp_path, capsys):
    argv = ["train", *(["--config", toml(tmp_path, text)] if text is not None else []), *flags]
    assert_one_line(*run_main(argv, capsys), needle)


def test_each_flag_is_declared_once_and_sets_its_setting():
    """One table declares every flag; a flag's value arrives at its setting, coerced by config."""
    from pipezero.cli.command_line import build_parser
    from pipezero.cli.flags import TRAIN_FLAGS, flag_values
    from pipezero.settings import build_config, setting_type

    flags = list(TRAIN_FLAGS)
    assert len(flags) == len(set(flags)) and len({k for k, _ in TRAIN_FLAGS.values()}) == len(flags)
    for key, _ in TRAIN_FLAGS.values():
        setting_type(key)  # every flag names a real setting
    args = build_parser().parse_args(["train", "--pp", "2", "--zero", "3", "--schedule", "gpipe", "--no-progress",
                                      "--recompute", "--stage-layers", "2,2", "--lr", "0.01"])
    settings, launch, names = flag_values(args)
    cfg = build_config(None, settings, names)
    assert (cfg.parallel.pp, cfg.parallel.zero, cfg.parallel.schedule.value) == (2, 3, "gpipe")
    assert cfg.run.progress is False and cfg.parallel.recompute is True
    assert cfg.parallel.stage_layers == [2, 2] and cfg.optim.lr == 0.01 and launch == {}


def test_tied_embeddings_from_toml_is_a_real_bool(tmp_path):
    from pipezero.settings import build_config

    assert build_config(toml(tmp_path, "[model]\ntie_embeddings = false\n")).model.tie_embeddings is False
    assert build_config(toml(tmp_path, "[model]\ntie_embeddings = true\n")).model.tie_embeddings is True


@pytest.fixture(scope="module")
def bad_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Files that are not what --data / --tokenizer need."""
    import numpy as np

    from pipezero.data.tokenizer import BPETokenizer

    root = tmp_path_factory.mktemp("bad-data")
    (root / "random.txt").write_bytes(np.random.default_rng(0).integers(0, 256, 8192, dtype=np.uint8).tobytes())
    (root / "text.txt").write_text("def f(x):\n    return x + 1\n" * 200)
    np.save(root / "big.npy", np.arange(5000, dtype=np.int64))
    np.save(root / "negative.npy", np.array([-1] + [1] * 100, dtype=np.int32))
    np.save(root / "float.npy", np.ones(100, dtype=np.float32))
    np.save(root / "object.npy", np.array([1, "a"] * 50, dtype=object), allow_pickle=True)
    (root / "odd.bin").write_bytes(b"\1" * 101)
    (root / "empty.bin").write_bytes(b"")
    (root / "broken.json").write_text('{"model": ')
    BPETokenizer.train(["hello world, hello tokens"] * 20, 300).hf.save(str(root / "small.json"))
    np.save(root / "beyond.npy", np.arange(400, dtype=np.uint16))
    return root


DATA_CASES = [
    (["--data", "random.txt"], "a binary file, not text"),
    (["--data", "big.npy"], "the token file's ids reach 4999 but the model only 4096 rows: set model.vocab_size >= 5000 (with --model-spec: your spec's vocab_size) or use ids below 4096"),
    (["--data", "negative.npy"], "holds negative ids (smallest -1)"),
    (["--data", "float.npy"], "holds float32 values; token ids must be integers"),
    (["--data", "object.npy"], "cannot be read as token ids"),
    (["--data", "odd.bin"], "holds 101 bytes, not a whole number of uint16 ids"),
    (["--data", "empty.bin"], "empty.bin' is empty: write its ids, or leave it out of --data"),
    (["--data", "text.txt", "--tokenizer", "broken.json"], "is not a Hugging Face tokenizer.json"),
    (["--data", "beyond.npy", "--tokenizer", "small.json"], "holds id 399, but the tokenizer"),
]


@pytest.mark.parametrize("flags,needle", DATA_CASES, ids=[c[0][1] for c in DATA_CASES])
def test_bad_data_is_one_line(flags, needle, bad_data, capsys, tmp_path):
    flags = [str(bad_data / f) if f.endswith((".txt", ".npy", ".bin", ".json")) else f for f in flags]
    argv = ["train", *flags, "--seq-len", "16", "--max-steps", "1", "--out", str(tmp_path / "run"), "--no-progress"]
    assert_one_line(*run_main(argv, capsys), needle)


def test_token_cache_follows_tokenizer_content_and_is_private(bad_data, tmp_path, monkeypatch):
    from pipezero.data.tokenizer import BPETokenizer
    from pipezero.data.cache_folder import cache_dir

    for i, vocab in enumerate((270, 300)):  # two tokenizers, both called tokenizer.json
        (tmp_path / str(i)).mkdir()
        BPETokenizer.train(["hello world, hello tokens"] * 20, vocab).hf.save(str(tmp_path / str(i) / "tokenizer.json"))
    a, b = (BPETokenizer.from_file(tmp_path / str(i) / "tokenizer.json") for i in (0, 1))
    assert a.name != b.name and a.name == BPETokenizer.from_file(tmp_path / "0" / "tokenizer.json").name
    monkeypatch.setenv("PIPEZERO_CACHE", str(tmp_path / "fresh" / "cache"))
    assert cache_dir().stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("flags,needle", [
    (["--data", "big.npy"], "set model.vocab_size >= 5000"),  # found by the launcher, not by each rank
    (["--data", "text.txt", "--tokenizer", "broken.json"], "is not a Hugging Face tokenizer.json"),
    (["--zero", "5"], "--zero 5: expected an integer >= 0 and <= 3"),
])
def test_launcher_says_it_once_before_ranks_start(flags, needle, bad_data, tmp_path, capsys, monkeypatch):
    """`--nproc 2` refuses these in the launching process, before torchrun or any rank starts (each
    rank would print the line again under torchrun's report): with no launcher at all, still one line."""
    monkeypatch.setattr("pipezero.launch.launch_local", no_launch)
    flags = [str(bad_data / f) if f.endswith((".txt", ".npy", ".json")) else f for f in flags]
    code, err = run_main(["train", "--nproc", "2", "--pp", "2", *flags, "--seq-len", "16",
                          "--out", str(tmp_path / "run")], capsys)
    assert_one_line(code, err, needle)
    assert not (tmp_path / "run").exists()


def test_run_folder_mistakes_are_one_line(tmp_path, capsys):
    from pipezero.rundir import claim

    args = ["train", "--max-steps", "1", "--no-progress", "--seq-len", "16"]
    held = tmp_path / "held"
    held.mkdir()
    (held / "metrics.jsonl").write_text('{"step": 1}\n')
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    cases = [
        (str(held), "holds metrics.jsonl but no run pipezero started (no .run-id, no checkpoints): a run would write "
                    "over them"),
        ("", "--out is empty"),
        (str(a_file), "is a file, not a folder"),
        (str(a_file / "sub"), "cannot be written"),
        ("/proc/pipezero-no-such-run", "cannot be written"),
    ]
    for out, needle in cases:
        assert_one_line(*run_main([*args, "--out", out], capsys), needle)
    if os.geteuid() != 0:  # root writes into a read-only folder anyway
        (tmp_path / "ro").mkdir(mode=0o500)
        assert_one_line(*run_main([*args, "--out", str(tmp_path / "ro" / "run")], capsys), "cannot be written")
    with claim(str(tmp_path / "busy"), resume=False, force=False):  # as another run would hold it
        assert_one_line(*run_main([*args, "--out", str(tmp_path / "busy"), "--resume"], capsys),
                        f"is in use by another run (pid {os.getpid()})")
    with claim(str(tmp_path / "busy"), resume=True, force=False):  # released: free again
        pass


def test_resume_in_a_folder_no_run_claimed_leaves_its_files_alone(tmp_path, capsys):
    """`--resume --out DIR` where DIR holds a config.json and metrics.jsonl of the user's (no .run-id,
    no checkpoints) started at step 0 and replaced both (the metrics line dropped as a torn step)."""
    args = ["train", "--max-steps", "1", "--no-progress", "--seq-len", "16", "--tokenizer", "bytes"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"mine": 1}')
    (mine / "metrics.jsonl").write_text("my notes")
    assert_one_line(*run_main([*args, "--out", str(mine), "--resume"], capsys),
                    "holds config.json, metrics.jsonl but no run pipezero started (no .run-id, no checkpoints)")
    assert sorted(p.name for p in mine.iterdir()) == ["config.json", "metrics.jsonl"]
    assert (mine / "metrics.jsonl").read_text() == "my notes"
    notes = tmp_path / "notes"  # files a run never writes: a first --resume (a requeued job) trains there
    notes.mkdir()
    (notes / "run.toml").write_text("")
    from pipezero.rundir import claim

    with claim(str(notes), resume=True, force=False):
        pass
    from pipezero.errors import ConfigError

    with pytest.raises(ConfigError, match="--force would write over them"):  # --force replaces only a run's
        claim(str(mine), resume=True, force=True)
    assert (mine / "metrics.jsonl").read_text() == "my notes"


def test_a_forced_run_that_would_save_over_the_other_runs_checkpoints_is_refused(tmp_path, capsys):
    """A save replaces the folder of its step: `--force` beside a run that saved step 2 may not save
    step 2 itself, and is told so before it starts; saving other steps beside it is fine."""
    from pipezero.checkpoint.state import clashes
    from pipezero.checkpoint.store import MANIFEST
    from pipezero.rundir import claim
    from pipezero.settings import build_config

    out = tmp_path / "run"
    (out / "checkpoints" / "step-00000002").mkdir(parents=True)
    (out / "checkpoints" / "step-00000002" / MANIFEST).write_text("{}")
    args = ["train", "--max-steps", "4", "--checkpoint-every", "2", "--no-progress", "--seq-len", "16",
            "--out", str(out), "--force"]
    assert_one_line(*run_main(args, capsys), "--force would write over the checkpoints of the run there "
                    "(step-00000002), saving the same steps (--checkpoint-every 2, --max-steps 4)")
    odd = build_config(None, {"run.out": str(out), "run.max_steps": 3, "run.checkpoint_every": 3})
    with claim(str(out), resume=False, force=True, clashes=lambda: clashes(odd)):  # saves step 3 only
        pass
    with claim(str(out), resume=True, force=True, clashes=lambda: "never asked"):  # --resume continues it
        pass


def test_pruning_and_resume_keep_to_their_own_run(tmp_path):
    import torch

    from pipezero.checkpoint.store import Team, committed, latest, write

    root = tmp_path / "checkpoints"
    write(root, 100, {"x": torch.zeros(4)}, {"run": "old"}, keep=1, team=Team())
    for step in (1, 2, 3):
        write(root, step, {"x": torch.full((4,), float(step))}, {"run": "new"}, keep=1, team=Team())
    assert [s for s, _ in committed(root)] == [3, 100]  # the new run pruned only its own
    assert latest(root, Team(), "new").manifest["step"] == 3  # and resumes from its own
    assert latest(root, Team(), None).manifest["step"] == 100


def test_partial_last_metrics_line_does_not_block_resume(tmp_path):
    import json

    from pipezero.telemetry.metrics import MetricsLog

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "lo')
    MetricsLog(path, keep_steps=2).close()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]


class _MakesDir:
    """A pickle payload that would create a folder when unpickled: harmless proof of code running."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def test_checkpoint_files_are_data_not_code(tmp_path, capsys, monkeypatch):
    import hashlib
    import json
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from pipezero.checkpoint.safe_reader import SafeReader, UnsafeCheckpoint
    from pipezero.checkpoint.store import CheckpointError, Team, latest, problems, read_manifest, write

    root = tmp_path / "checkpoints"
    good, bad = (write(root, s, {"x": torch.full((4,), float(s))}, {}, keep=5, team=Team()) for s in (4, 5))
    manifest = json.loads((bad / "manifest.json").read_text())

    def with_manifest(**changes):
        (bad / "manifest.json").write_text(json.dumps({**manifest, **changes}))

    for changes, needle in [({"step": 4}, "step 4 but the folder is step-00000005"),
                            ({"step": "5"}, "is not a step number"),
                            ({"files": {}}, "no files listed"),
                            ({"files": {"/etc/passwd": {"bytes": 1, "sha256": "0"}}}, "not a plain name"),
                            ({"files": {"../x": {"bytes": 1, "sha256": "0"}}}, "not a plain name"),
                            ({"files": {".metadata": "x"}}, "lacks an integer size")]:
        with_manifest(**changes)
        with pytest.raises(CheckpointError, match=needle):
            read_manifest(bad)
        assert needle in problems(bad, Team())
    (bad / "manifest.json").write_text("[1, 2")  # unreadable: falls back like a bad checksum
    assert latest(root, Team()).path == good and "unreadable manifest.json" in capsys.readouterr().err

    # metadata that would run code: refused, nothing runs, and the previous checkpoint is used
    marker = tmp_path / "code-ran"
    (bad / ".metadata").write_bytes(pickle.dumps(_MakesDir(str(marker))))
    data = (bad / ".metadata").read_bytes()
    manifest["files"][".metadata"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    with_manifest()
    with pytest.raises(UnsafeCheckpoint, match="posix.mkdir, which is not checkpoint metadata"):
        SafeReader(bad).read_metadata()
    assert latest(root, Team()).path == good and not marker.exists()
    assert "refusing to load it" in capsys.readouterr().err
    SafeReader(good).read_metadata()  # real metadata passes the same unpickler

    # DCP's CheckpointException is a BaseException: one line keeping each rank's cause
    failure = CheckpointException("boom", {0: (OSError("No space left on device"), None)})
    with pytest.raises(CheckpointError, match=r"^rank 0, step 0: checkpoint save failed: rank 0: OSError: "
                                              r"No space left on device$"):
        Team().run("save", lambda: (_ for _ in ()).throw(failure))

    def full_disk(*args, **kwargs):
        raise failure

    monkeypatch.setattr(dcp, "save", full_disk)
    with pytest.raises(CheckpointError, match="No space left"):
        write(root, 6, {"x": torch.zeros(4)}, {}, keep=5, team=Team())
    assert not (root / ".tmp-step-00000006").exists()  # a failed save leaves no debris

    # export of a named checkpoint checks it first
    from pipezero.checkpoint.export import export
    from pipezero.errors import ConfigError

    (good / "__0_0.distcp").write_bytes(b"\0" * (good / "__0_0.distcp").stat().st_size)
    with pytest.raises(ConfigError, match="cannot be exported: checksum mismatch"):
        export(good, tmp_path / "export")


SIM_CASES = [
    (["simulate", "--comm", "-5"], "--comm = -5.0: expected a number >= 0"),
    (["simulate", "--pp", "0"], "--pp = 0: expected an integer >= 1"),
    (["simulate", "--cost", "nan:1:1"], "--cost nan:1:1: expected three numbers > 0"),
    (["simulate", "--cost", "inf:1:1"], "--cost inf:1:1: expected three numbers > 0"),
    (["simulate", "--compare", "--png", "{png}"], "--png draws one schedule's timeline"),
    (["simulate", "--compare", "--zero", "1", "--png", "{png}"], "--png draws one schedule's timeline"),
    (["simulate", "--from-trace", "{empty}"], "is not a pipezero trace.json (not JSON: Expecting value at line 1"),
    (["simulate", "--from-trace", "{notjson}"], "is not a pipezero trace.json (not JSON: "),
    (["simulate", "--from-trace", "{notrace}"], "is not a pipezero trace.json"),
    (["plan", "--params", "-5", "--gpus", "8", "--gpu-memory", "80"], "--params = -5.0: expected a number >= 1000000"),
    (["plan", "--preset", "tiny", "--gpus", "8", "--gpu-memory", "80", "--bandwidth", "0,0"],
     "--bandwidth 0,0: expected two numbers > 0"),
    (["plan", "--preset", "tiny", "--gpus", "8", "--gpu-memory", "80", "--seq-len", "0"],
     "--seq-len = 0: expected an integer >= 1"),
    (["plan", "--preset", "tiny", "--gpus", "8", "--gpu-memory", "80", "--node-size", "0"],
     "--node-size = 0: expected an integer >= 1"),
    (["plan", "--preset", "tiny", "--gpus", "2", "--gpu-memory", "80", "--seq-len", "2048"],
     "--seq-len 2048 is longer than the model's max_seq_len 1024 (train refuses it)"),
    (["plan", "--preset", "tiny", "--gpus", "3", "--gpu-memory", "80"],
     "3 GPUs split into no layout: pp x dp must equal --gpus with pp <= 2 layers and dp dividing --global-batch "
     "1024; choose --gpus 2 or 4"),
]


@pytest.mark.parametrize("argv,needle", SIM_CASES, ids=[" ".join(c[0][:3]) + c[1][:12] for c in SIM_CASES])
def test_bad_simulate_and_plan_input_is_one_line(argv, needle, tmp_path, capsys):
    files = {"empty": "", "notjson": '{"traceEvents": [', "notrace": '{"hello": 1}', "png": ""}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    argv = [str(tmp_path / a[1:-1]) if a[1:-1] in files else a for a in argv]
    assert_one_line(*run_main(argv, capsys), needle)


@pytest.mark.parametrize("argv, needle", [
    ([*TRAIN_TINY, "--data", ""], "--data '' is empty: name document files"),  # not "--out is inside --data ''"
    ([*TRAIN_TINY, "--model", ""], "--model is empty: name a local Hugging Face model folder"),
    (["export", "", "--out", "e"], "the source is empty: pass a run directory"),
    ([*TRAIN_TINY, "--quant-block", "7"], "--quant-block 7 applies with --quantize-weights or --quantize-grads"),
    ([*TRAIN_TINY, "--timeout", "0.5"], "--timeout 0.5: expected a number >= 1 and <= 604800"),
    ([*TRAIN_TINY, "--timeout", "1e-300"], "--timeout 1e-300: expected a number >= 1"),  # 0 ms: every connect would fail
])
def test_an_empty_or_ignored_or_unusable_value_is_one_line(argv, needle, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert_one_line(*run_main(argv, capsys), needle)


def test_json_nested_too_deep_is_one_line_wherever_it_is_read(tmp_path, capsys):
    from pipezero.checkpoint import CheckpointError
    from pipezero.checkpoint.store import read_manifest
    from pipezero.errors import ConfigError
    from pipezero.models.hf import read_json
    from pipezero.telemetry.metrics import _records

    (tmp_path / "config.json").write_text(DEEP)
    with pytest.raises(ConfigError, match="config.json is not readable json: maximum recursion depth"):
        read_json(tmp_path / "config.json")
    (tmp_path / "manifest.json").write_text(DEEP)
    with pytest.raises(CheckpointError, match="unreadable manifest.json: maximum recursion depth"):
        read_manifest(tmp_path)
    assert _records(f'{DEEP}\n{{"step": 1}}\n') == [{"step": 1}]  # a resume skips the line
    (tmp_path / "trace.json").write_text(DEEP)
    assert_one_line(*run_main(["simulate", "--from-trace", str(tmp_path / "trace.json")], capsys),
                    "is not a pipezero trace.json (it is nested too deep)")


def test_a_stall_report_at_or_past_the_timeout_is_refused():
    """The watchdog reports a wait that passed --stall-report; past --timeout the wait has already
    failed, so such a setting would silently never report: refused in one line."""
    from pipezero.errors import ConfigError
    from pipezero.settings import build_config

    with pytest.raises(ConfigError, match="--stall-report 60 is not below --timeout 30"):
        build_config(overrides={"parallel.stall_report_s": 60.0, "parallel.timeout_s": 30.0})
    assert build_config(overrides={"parallel.stall_report_s": 5.0, "parallel.timeout_s": 30.0})


def test_a_model_setting_beside_model_or_model_spec_is_named_as_the_user_set_it(tmp_path, capsys):
    """The fix names the flag the user typed (drop --preset), the TOML key only for a TOML setting."""
    (tmp_path / "m").mkdir()
    assert_one_line(*run_main(["train", "--model", str(tmp_path / "m"), "--preset", "tiny"], capsys),
                    f"--model {tmp_path / 'm'} fixes the model's shape; drop --preset")
    assert_one_line(*run_main(["train", "--model-spec", "x:y", "--preset", "tiny"], capsys),
                    "--model-spec x:y is the whole model; drop --preset")
    (tmp_path / "p.toml").write_text('[model]\npreset = "tiny"\n')
    assert_one_line(*run_main(["train", "--config", str(tmp_path / "p.toml"), "--model", str(tmp_path / "m")], capsys),
                    f"drop model.preset (in {tmp_path / 'p.toml'})")


@pytest.mark.parametrize("flags, needle", [
    (["--microbatches", "1000000000"], "--pp 1 x --microbatches 1000000000 x --virtual-stages 1 = 1000000000 stage "
                                       "micro-batches a step; the limit is 65536"),  # proving 10^9 would never end
    (["--pp", "2", "--microbatches", "40000"], "= 80000 stage micro-batches a step"),
    (["--micro-batch-size", "1000000000"], "= 1000000000 sequences of --seq-len 16 = 16000000000 tokens a step; "
                                           "the limit is 268435456"),  # a 119 GiB allocation otherwise
])
def test_a_step_past_what_a_rank_can_build_or_hold_is_one_line(flags, needle, tmp_path, capsys):
    argv = ["train", "--preset", "tiny", "--max-steps", "1", "--seq-len", "16", "--microbatches", "1",
            "--out", str(tmp_path / "o"), *flags]
    assert_one_line(*run_main(argv, capsys), needle)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv", [[*TRAIN_TINY, "--out", "{long}"], [*TRAIN_TINY, "--data", "{long}.txt"],
                                  ["simulate", "--png", "{long}.png"], ["export", "{long}", "--out", "e"]])
def test_a_name_too_long_for_the_filesystem_is_one_line(argv, tmp_path, capsys, monkeypatch):
    """Path.exists raises OSError (File name too long) for such a name: checked before any other use."""
    monkeypatch.chdir(tmp_path)
    long = "x" * 300
    code, err = run_main([a.format(long=long) for a in argv], capsys)
    assert_one_line(code, err, "characters)' is too long for this filesystem (File name too long)")


@pytest.mark.parametrize("argv, needle", [
    ([*TRAIN_TINY, "--tokenizer", "gpt2"], "--tokenizer (data.tokenizer) 'gpt2': use 'bpe', 'bytes' or a tokenizer.json"),
    (["train", "--config", "{toml}"], "model.spec (in {toml}) x:y is the whole model; drop model.pretrained (in {toml})"),
])
def test_a_setting_is_named_as_the_user_gave_it(argv, needle, tmp_path, capsys):
    """--tokenizer by its flag (and key); a spec the TOML file named by its key and file."""
    toml = tmp_path / "c.toml"
    toml.write_text('[model]\nspec = "x:y"\npretrained = "m"\n')
    assert_one_line(*run_main([a.format(toml=toml) for a in argv], capsys), needle.format(toml=toml))


@pytest.mark.parametrize("argv, needle", [
    (["train", "--config", "", "--out", "{tmp}/o"], "--config is empty: name a .toml file"),  # not "no file": the defaults
    (["simulate", "--png", ""], "--png is empty"),  # else nothing is drawn
    (["simulate", "--from-trace", ""], "--from-trace is empty"),  # not the defaults instead
    (["simulate", "--memory", "--config", " "], "--config is empty"),
    (["export", "{run}", "--out", "{tmp}/e", "--model-spec", ""], "--model-spec is empty"),  # not "no spec given"
    (["doctor", ""], "the run folder is empty"),  # not the working directory
])
def test_an_empty_value_is_refused_not_read_as_absent(argv, needle, trained_run, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{run}", str(trained_run)) for a in argv]
    assert_one_line(*run_main(argv, capsys), needle)
    assert not (tmp_path / "o").exists() and not (tmp_path / "e").exists()


@pytest.mark.parametrize("steps", [str(2**63), "100000000000000000000"])
def test_a_step_count_past_any_run_is_refused(steps, tmp_path, monkeypatch, capsys):
    """The step counter a checkpoint keeps is int64: a count past it (from a flag, or 10^20 in a
    TOML) would train on as if reachable."""
    monkeypatch.chdir(tmp_path)
    write_docs(tmp_path)
    code, err = run_main([*TRAIN_TINY_SMALLEST[:3], *TRAIN_TINY_SMALLEST[5:], "--max-steps", steps, "--data", "docs",
                          "--out", "run"], capsys)
    assert_one_line(code, err, "--max-steps")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("extra", [["--zero", "2", "--zero3-prefetch", "2"], ["--zero3-prefetch", "3"]])
def test_zero3_prefetch_without_zero3_is_one_line(extra, tmp_path, capsys):
    """Under another stage nothing reads --zero3-prefetch: refused, as an unread --link-gbps or
    --tflops is."""
    from one_line import assert_one_line, run_main

    code, err = run_main(["train", "--preset", "tiny", "--tokenizer", "bytes", "--max-steps", "1", *extra,
                          "--out", str(tmp_path / "o")], capsys)
    assert_one_line(code, err, f"--zero3-prefetch {extra[-1]} is read only by ZeRO-3")
    assert not (tmp_path / "o").exists()


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
    write_docs(tmp_path, 8, "some words to train on, file {i} ", 20)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PIPEZERO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("pipezero.launch.launch_local", no_launch)
    code, err = run_main(["train", *TINY_FLAGS, "--data", "docs", "--max-steps", "1", "--no-progress", "--out", "o",
                          "--zero", "3", "--dp", "2", "--nproc", "2", "--secondary-shard", "node"], capsys)
    assert_one_line(code, err, "--secondary-shard node with every replica of a stage on one node")
    assert not (tmp_path / "o").exists()


def test_hierarchical_with_one_replica_is_refused(tmp_path, capsys):
    code, err = run_main(["train", "--hierarchical", "--max-steps", "1", "--out", str(tmp_path / "o")], capsys)
    assert_one_line(code, err, "--hierarchical with --dp 1: there are no data-parallel reductions to split by node")
    assert not (tmp_path / "o").exists()
