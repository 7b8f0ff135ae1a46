"""What metrics.jsonl and summary.json tell a user about throughput: counted the same way however
the data are packed, and carried across a resume."""

import json

from pipezero.cli import main
from pipezero.data import load_corpus
from pipezero.data.packing import IGNORE
from pipezero.settings import build_config


def short_documents(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n"}) + "\n" for i in range(400)))
    return path


def records(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_tokens_count_the_targets_trained_not_the_padding(tmp_path):
    """With `--packing none` each row is one short document, cut to its micro-batch's length: the
    run reads far fewer than global batch x --seq-len tokens, and tokens/s must not count the rest."""
    args = ["--data", str(short_documents(tmp_path)), "--tokenizer", "bytes", "--packing", "none",
            "--seq-len", "64", "--max-steps", "2", "--sample-tokens", "0"]
    out = tmp_path / "run"
    assert main(["train", *args, "--out", str(out), "--no-progress"]) == 0
    cfg = build_config(None, {"data.path": args[1], "data.tokenizer": "bytes", "data.packing": "none",
                              "data.seq_len": 64})
    corpus = load_corpus(cfg.data)
    g = cfg.global_batch
    trained = [int((corpus.batch(s, s * g, cfg.run.seed, g, 64)[1] != IGNORE).sum()) for s in range(2)]
    assert trained[0] < g * 64 // 2  # the documents are short: most of each row is not trained on
    lines = records(out)
    assert [r["tokens"] for r in lines] == [trained[0], trained[0] + trained[1]]
    for r, n in zip(lines, trained):
        assert abs(r["tokens_per_s"] - n / r["step_time_s"]) <= 1e-6 * r["tokens_per_s"]


def test_tokens_run_on_across_a_resume_with_another_global_batch(tmp_path, text_dir):
    """A resume may change the global batch (README: allowed and warned about): `tokens` goes on
    from the kept log's total, not the new batch size times the step."""
    out = tmp_path / "run"
    common = ["train", "--data", str(text_dir), "--tokenizer", "bytes", "--seq-len", "32", "--sample-tokens", "0",
              "--eval-every", "0", "--out", str(out), "--no-progress"]
    assert main([*common, "--max-steps", "2", "--checkpoint-every", "2"]) == 0
    assert main([*common, "--max-steps", "3", "--microbatches", "8", "--resume"]) == 0
    lines = records(out)
    assert [r["step"] for r in lines] == [1, 2, 3]
    assert [r["tokens"] for r in lines] == [16 * 32, 2 * 16 * 32, 2 * 16 * 32 + 32 * 32]


def test_end_of_run_sample_draws_only_tokens_the_tokenizer_decodes(tmp_path, text_dir):
    """The tiny model has 4096 embedding rows and the byte tokenizer 256 ids: after a few steps the
    rows beyond 256 still carry probability, and every id sampled there decoded to nothing, so a
    64-token sample printed a handful of characters."""
    from pipezero.engine import train

    cfg = build_config(None, {"data.path": str(text_dir), "data.tokenizer": "bytes", "run.max_steps": 2,
                              "data.seq_len": 32, "run.out": str(tmp_path / "run"), "run.progress": False,
                              "run.sample_tokens": 64})
    text = train(cfg).sample_text
    assert text.startswith("def ")
    assert len(text) >= (4 + 64) // 4  # 68 bytes decode to at least 17 characters (at most 4 bytes each)


def test_a_host_with_more_ranks_than_cores_is_named_beside_the_bubble():
    from pipezero.summary import shared_cores

    two_hosts = [{"host": "a", "cores": 2}] * 4 + [{"host": "b", "cores": 8}] * 2
    assert shared_cores(two_hosts) == {"host": "a", "ranks": 4, "cores": 2}
    assert shared_cores([{"host": "a", "cores": 4}] * 4) is None  # one core a rank: nothing to say


def test_no_progress_prints_a_plain_line_a_step(tmp_path, capsys):
    """--no-progress promises plain log lines instead of a bar: one a step (loss, tokens/s) beside
    the run's opening and closing lines, on stdout (a log), where it printed nothing at all; stderr
    stays for what went wrong."""
    args = ["--data", str(short_documents(tmp_path)), "--tokenizer", "bytes", "--seq-len", "16", "--max-steps", "3",
            "--sample-tokens", "0", "--out", str(tmp_path / "run"), "--no-progress"]
    assert main(["train", *args]) == 0
    out, err = capsys.readouterr()
    steps = [x for x in out.splitlines() if x.startswith("step ")]
    assert [x.split()[1] for x in steps] == ["1/3", "2/3", "3/3"] and all(" loss " in x and "tok/s" in x for x in steps)
    assert "layout pp=1" in out and "held-out loss" in out and "step " not in err, (out, err)


def test_ctrl_c_in_the_text_sample_still_writes_the_summary(tmp_path, monkeypatch, capsys):
    """A long --sample-tokens ran for minutes without a word, and a Ctrl-C there lost summary.json of
    a run already trained and saved: it is announced, and an interrupt skips only the sample."""
    from one_line import run_main
    from tiny_runs import TRAIN_TINY_BYTES, write_docs

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("pipezero.runtime.executor.Executor.sample", interrupted)
    code, err = run_main([*TRAIN_TINY_BYTES, "--microbatches", "1", "--micro-batch-size", "1", "--sample-tokens",
                          "4096", "--data", str(write_docs(tmp_path)), "--out", str(tmp_path / "o")], capsys)
    assert code == 0, err
    assert "sampling 4096 tokens of text (Ctrl-C skips it" in err and "text sample skipped (Ctrl-C)" in err
    assert (tmp_path / "o" / "summary.json").is_file()


def test_the_runs_lines_print_paths_and_text_as_written(capsys):
    """A run's lines carry what a user wrote (--out, --data) and what the model drew: read as rich
    markup, --out 'r[/x]' would end a finished run in a MarkupError and 'r[red]x' would show as
    'rx', a folder that does not exist."""
    from pipezero.telemetry.metrics import StepProgress

    for bar in (False, True):
        StepProgress(1, 0, True, bar=bar).console.print("run in r[/x] and r[red]x :smile:")
        out = capsys.readouterr()
        assert "run in r[/x] and r[red]x :smile:" in (out.err if bar else out.out), out


def test_the_sample_shows_control_characters_escaped():
    """An untrained byte-level model draws any byte: ESC, NUL or a bell reached the terminal raw."""
    from pipezero.summary import printable

    assert printable("def f():\n\treturn 1\x1b[2J\x00\x07é") == "def f():\n\treturn 1\\x1b[2J\\x00\\x07é"


def test_the_sample_draws_nothing_after_logits_that_are_not_finite():
    """The text-sample program plays every forward as written (its gathers and releases inside them
    are the program's); once a token's logits were not finite the sampler draws nothing more, whatever
    the forwards after compute."""
    import torch

    from pipezero.generate import Sampler

    s = Sampler([1, 2], max_seq_len=8, seed=0, vocab=4)
    s.take(torch.tensor([0.0, 1.0, 2.0, 3.0]))
    assert len(s.ids) == 3 and not s.done
    s.take(torch.tensor([0.0, float("nan"), 2.0, 3.0]))
    s.take(torch.tensor([0.0, 1.0, 2.0, 3.0]))
    assert s.done and len(s.ids) == 3
