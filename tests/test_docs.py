"""The documentation against the code: help texts exist, the commands the guides show still parse,
the generated reference covers every flag and key, and the first tutorial runs as written.

The reference pages are written at build time by docs/hooks/reference.py; these tests call its
generators in-process, so a flag or key the reference would miss fails here before the site builds.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pipezero.cli.command_line import build_parser
from pipezero.cli.flags import TRAIN_FLAGS
from pipezero.settings import coerce_setting

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
GUIDES = sorted((DOCS / "tutorials").glob("*.md")) + sorted((DOCS / "how-to").glob("*.md"))


def _hook():
    spec = importlib.util.spec_from_file_location("docs_reference_hook", DOCS / "hooks" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


reference = _hook()


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def shown_commands(text: str) -> list[str]:
    """Every command line inside the page's fenced code blocks, continuation lines joined: all lines
    of a `bash` (or untagged) block, the `$ ` lines of a `console` block, none of a `text` block
    (program output)."""
    commands, kind, pending = [], None, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            kind = (line.strip()[3:].strip() or "bash") if kind is None else None
            pending = ""
            continue
        if kind not in ("bash", "console"):
            continue
        line = pending + line.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        if kind == "console" and not line.startswith("$ "):
            continue
        commands.append(line[2:] if line.startswith("$ ") else line)
    return commands


def pipezero_argv(command: str) -> list[str] | None:
    """The arguments after `pipezero` (or `python -m pipezero.cli`) in a shell line, else None."""
    words = shlex.split(command, comments=True)
    for i, word in enumerate(words):
        if word == "pipezero" and i == 0:
            return words[1:]
        if word == "pipezero.cli" and i > 0 and words[i - 1] == "-m":
            return words[i + 1:]
    return None


def check_parses(argv: list[str]) -> None:
    """Parse `argv` with the CLI's own parser, then check every run setting's value the way `train`
    does; `cluster`'s command is parsed in turn. A renamed or removed flag is a SystemExit here."""
    args = build_parser().parse_args(argv)
    name = argv[0]  # `cluster`'s own positional is called `command` too
    if name in ("train", "verify"):
        for flag, (key, _) in TRAIN_FLAGS.items():
            value = getattr(args, key, None)
            if value is not None:
                coerce_setting(key, value, from_text=True, name=flag)
    if name == "cluster":
        check_parses(list(args.command))


def test_every_flag_has_help_text():
    missing = [f"{name} {a.option_strings or a.dest}" for name, p in _subcommands(build_parser()).items()
               for a in p._actions if not (a.help or "").strip()]
    assert not missing, f"flags without help text: {missing}"


def test_every_config_key_has_a_docstring():
    missing = [key for key, doc in reference.config_keys().items() if not doc.strip()]
    assert not missing, f"configuration keys without a docstring in config.py: {missing}"


def test_guides_show_commands():
    """The parse test below is only as good as the commands it finds: every guide shows some."""
    for page in GUIDES:
        found = [c for c in shown_commands(page.read_text()) if pipezero_argv(c) is not None]
        assert found, f"{page.relative_to(ROOT)} shows no pipezero command"


@pytest.mark.parametrize("page", GUIDES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_guide_commands_parse(page, capsys):
    for command in shown_commands(page.read_text()):
        argv = pipezero_argv(command)
        if argv is None:
            continue
        try:
            check_parses(argv)
        except SystemExit as e:
            pytest.fail(f"{page.name}: `{command}` does not parse (exit {e.code}): {capsys.readouterr().err.strip()}")


def test_a_renamed_flag_fails_the_parse():
    with pytest.raises(SystemExit):
        check_parses(["train", "--pipeline-stages", "2"])
    with pytest.raises(SystemExit):
        check_parses(["cluster", "--nodes", "2", "train", "--pipeline-stages", "2"])


def _sections(page: str) -> dict[str, str]:
    parts = re.split(r"^## `pipezero (\S+)`.*$", page, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_reference_covers_every_flag_of_every_command():
    page = reference.cli_page()
    sections = _subcommands(build_parser())
    written = _sections(page)
    assert set(written) == set(sections)
    train = written["train"]
    for name, parser in sections.items():
        for action in parser._actions:
            for flag in action.option_strings or [action.dest]:
                cell = f"`{flag}`"
                assert cell in written[name] or (cell in train and "every flag of [`train`]" in written[name]), \
                    f"pipezero {name} {flag} is not on the reference page"


def test_reference_covers_every_config_key_and_output_field():
    from pipezero.schedules.registry import SCHEDULES
    from pipezero.summary import RANK_FIELDS, SUMMARY_FIELDS
    from pipezero.telemetry.metrics import FIELDS

    config = reference.configuration_page()
    for key, doc in reference.config_keys().items():
        assert f"### `{key}` {{#{key}}}" in config, key
        assert " ".join(doc.split())[:60] in " ".join(config.split()), key
    outputs = reference.outputs_page()
    for name in [*FIELDS, *SUMMARY_FIELDS, *RANK_FIELDS]:
        assert f"| `{name}` |" in outputs, name
    schedules = reference.schedules_page()
    for kind in SCHEDULES:
        assert f"## `{kind.value}`" in schedules, kind


def test_every_generated_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    for uri in reference.PAGES:
        assert uri in nav, uri


# Two steps: the metrics hold a line a step and the final checkpoint is the last step's, past a step
# boundary; each step more of the two training lines is ~1.7 CPU-seconds of 4 ranks and no new check.
FIRST_RUN_STEPS = 2


@pytest.mark.distributed
@pytest.mark.slow(245)
def test_first_tutorial_runs(tmp_path):
    """Every shell line of the first tutorial, as written but for fewer steps and without the
    install line; then what it says the run wrote is there, each field declared for the reference."""
    import json

    from pipezero.summary import RANK_FIELDS, SUMMARY_FIELDS
    from pipezero.telemetry.metrics import FIELDS, REQUIRED_FIELDS

    text = (DOCS / "tutorials" / "first-run.md").read_text()
    lines = [c for c in shown_commands(text) if c and not c.startswith(("python3 -m venv", "pip "))]
    assert any(c.startswith("pipezero train") for c in lines) and any(c.startswith("pipezero verify") for c in lines)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for line in lines:
        line = re.sub(r"--max-steps \d+", f"--max-steps {FIRST_RUN_STEPS}", line)
        if line.startswith("pipezero verify"):
            line += " --steps 2"
        done = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"`{line}` exited {done.returncode}:\n{done.stderr[-3000:]}"
    run = tmp_path / "runs" / "tiny"
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, FIRST_RUN_STEPS + 1))
    for r in records:
        assert set(REQUIRED_FIELDS) <= set(r) <= set(FIELDS)
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary) == set(SUMMARY_FIELDS)
    for rank in summary["ranks"]:
        assert set(rank) <= set(RANK_FIELDS)
    assert (tmp_path / "runs" / "traced" / "trace.png").is_file()
    assert [p.name for p in (run / "checkpoints").iterdir()] == [f"step-{FIRST_RUN_STEPS:08d}"]  # no --checkpoint-every
    assert (tmp_path / "runs" / "tiny-model" / "model.safetensors").is_file()
    assert (tmp_path / "runs" / "1f1b-sim.png").is_file()
    assert (tmp_path / "runs" / "check" / "verify.json").is_file()
