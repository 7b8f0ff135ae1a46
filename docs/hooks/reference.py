"""The reference pages, written from the code at build time so that they cannot drift from it.

MkDocs runs this file as a hook (`hooks:` in mkdocs.yml): `on_files` adds four pages that exist
only in the built site, never in the repository, so there is nothing to forget to regenerate:

- reference/cli.md: every command and flag, read from the CLI's own argparse parser (the same
  object `pipezero` parses with), each `train` flag beside the setting it overrides;
- reference/configuration.md: every configuration key with what it accepts (type and range, as
  settings.py checks it), its default and its docstring, from config.py's dataclasses and the
  RANGES table; the presets from models/presets.py;
- reference/outputs.md: the fields of metrics.jsonl and summary.json, from the tables the run
  writes them against;
- reference/schedules.md: the schedule registry.

Each page is a function returning Markdown, so tests/test_docs.py calls them in-process and
checks that every flag and every key is on its page.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import functools
import inspect
from typing import Any

from pipezero import config
from pipezero.cli.command_line import build_parser
from pipezero.cli.flags import TRAIN_FLAGS
from pipezero.coerce import shown
from pipezero.coerce import describe
from pipezero.settings import RANGES, setting_type

SECTIONS: dict[str, type] = {"model": config.ModelConfig, "parallel": config.ParallelConfig,
                             "optim": config.OptimConfig, "data": config.DataConfig, "run": config.RunConfig,
                             "launch": config.LaunchConfig}

GENERATED = "This page is generated from the code when the site is built."


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """A dataclass's attribute docstrings (the string literal under each field), by field name.
    A field without one is missing from the result, which tests/test_docs.py turns into a failure."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def config_keys() -> dict[str, str]:
    """Every setting as `section.field` -> its docstring ('' when it has none)."""
    return {f"{name}.{f.name}": field_docs(cls).get(f.name, "")
            for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


def _cell(text: Any) -> str:
    """Text fit for one Markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(f: dataclasses.Field) -> str:
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if value is None:
        return "unset"
    return f"`{shown(value.value if isinstance(value, enum.Enum) else value)}`"


def _flag_of(key: str) -> str | None:
    return next((flag for flag, (k, _) in TRAIN_FLAGS.items() if k == key), None)


def configuration_page() -> str:
    from pipezero.models.presets import PRESET_LR, PRESET_WARMUP, PRESETS

    lines = ["# Configuration keys", "", GENERATED, "",
             "A run's settings come from four layers, later ones winning: these defaults, the preset's shape, "
             "learning rate and warm-up, a TOML file (`--config run.toml`, one table a section: `[model]`, "
             "`[parallel]`, `[optim]`, `[data]`, `[run]`), and command-line flags. Every value, whatever its "
             "source, is checked against what its key accepts below; a mistake is one line naming the key, exit "
             "status 2. TOML values must have the key's type (`pp = 2`, not `pp = \"2\"`; an integer key refuses "
             "`2.5` and `64.0`; a bool is `true` or `false`). The global batch is `parallel.microbatches` x "
             "`parallel.micro_batch_size` x `parallel.dp` sequences of `data.seq_len` tokens, and the sequences of "
             "step s depend only on the seed, the data, the global batch and the sequence length, never on the "
             "layout. Defaults below are the dataclasses'; `model.preset` replaces the shape keys and the learning "
             "rate and warm-up with its own (the table at the end).", ""]
    for name, cls in SECTIONS.items():
        title = "[launch] (command line only)" if name == "launch" else f"[{name}]"
        lines += [f"## {title}", "", inspect.cleandoc(cls.__doc__ or ""), ""]
        if name == "launch":
            lines += ["These settings say how ranks are started, not what they compute: they are flags only, "
                      "never in a TOML file or a run's config.json.", ""]
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            key = f"{name}.{f.name}"
            flag = _flag_of(key)
            lines += [f"### `{key}` {{#{key}}}", "", docs.get(f.name, ""), "",
                      f"- type: {describe(setting_type(key))}",
                      f"- default: {_default(f)}"]
            if key in RANGES:
                lines.append(f"- range: {RANGES[key].describe()}")
            if flag:
                lines.append(f"- flag: [`{flag}`](cli.md#train)")
            lines.append("")
    lines += ["## Presets", "", "`model.preset` fills the shape keys and brings a peak learning rate and a "
              "warm-up (models/presets.py); keys set explicitly still win.", "",
              "| preset | shape | peak lr | warm-up steps |", "|---|---|---|---|"]
    default_warmup = config.OptimConfig().warmup_steps
    for preset, shape in PRESETS.items():
        lines.append(f"| `{preset}` | {_cell(', '.join(f'{k}={v}' for k, v in shape.items()))} | "
                     f"{PRESET_LR[preset]:g} | {PRESET_WARMUP.get(preset, default_warmup)} |")
    return "\n".join(lines) + "\n"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.help != argparse.SUPPRESS]


def option_names(parser: argparse.ArgumentParser) -> dict[str, set[str]]:
    """Each command's flags and positionals, as they are written on its reference."""
    return {name: {a.option_strings[0] if a.option_strings else a.dest for a in _flags(p)}
            for name, p in _subcommands(parser).items()}


def _value(a: argparse.Action) -> str:
    if a.nargs == 0:
        return "switch"
    if a.choices:
        return " \\| ".join(f"`{c}`" for c in a.choices)
    metavar = a.metavar or (a.dest.upper() if a.option_strings else a.dest)
    return f"`{metavar}`" + (" ..." if a.nargs in ("+", "*", argparse.REMAINDER) else "")


def cli_page() -> str:
    parser = build_parser()
    commands = _subcommands(parser)
    help_of = {c.dest: c.help for c in next(a for a in parser._actions
                                            if isinstance(a, argparse._SubParsersAction))._choices_actions}
    setting = {flag: key for flag, (key, _) in TRAIN_FLAGS.items()}
    train = {a.option_strings[0] for a in _flags(commands["train"]) if a.option_strings} - {"-h"}
    lines = ["# Commands and flags", "", GENERATED, "",
             "Read from `pipezero.cli.command_line.build_parser()`, the parser `pipezero` itself parses with. A bad command "
             "line is one line on stderr and exit status 2.", "",
             "| command | what it does |", "|---|---|"]
    lines += [f"| [`{name}`](#{name}) | {_cell(help_of.get(name, ''))} |" for name in commands]
    lines.append("")
    for name, p in commands.items():
        lines += [f"## `pipezero {name}` {{#{name}}}", "", _cell(p.description or help_of.get(name, "")), "",
                  "```text", p.format_usage().strip(), "```", ""]
        actions = _flags(p)
        mine = {a.option_strings[0] for a in actions if a.option_strings} - {"-h"}
        inherited = name != "train" and train <= mine
        if inherited:
            lines += [f"`{name}` takes every flag of [`train`](#train), and these:", ""]
            actions = [a for a in actions if not (a.option_strings and a.option_strings[0] in train)]
        lines += ["| flag | value | default / setting | what it does |", "|---|---|---|---|"]
        for a in actions:
            names = ", ".join(f"`{s}`" for s in a.option_strings) or f"`{a.dest}`"
            key = setting.get(a.option_strings[0]) if a.option_strings else None
            if key:
                default = f"[`{key}`](configuration.md#{key})"
            elif a.nargs == 0 or a.default in (None, argparse.SUPPRESS):
                default = ""
            else:
                default = f"`{a.default}`"
            lines.append(f"| {names} | {_value(a)} | {default} | {_cell(a.help)} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def outputs_page() -> str:
    from pipezero.summary import RANK_FIELDS, SUMMARY_FIELDS
    from pipezero.telemetry.metrics import FIELDS, REQUIRED_FIELDS

    lines = ["# What a run writes", "", GENERATED, "",
             "`train --out OUT` writes `OUT/config.json` (the run's configuration, every key of "
             "[Configuration keys](configuration.md)), `OUT/metrics.jsonl` and `OUT/summary.json`; with "
             "`--trace` also `OUT/trace.json` and `OUT/trace.png`, with `--tensorboard` `OUT/tensorboard/`, "
             "with `--checkpoint-every` `OUT/checkpoints/step-N/`. `pipezero verify` writes `OUT/verify.json`.",
             "", "## metrics.jsonl", "",
             "One JSON object a line, one line a step, written by rank 0 and flushed as written "
             "(telemetry/metrics.py `FIELDS`; a field missing from that table is refused when written).", "",
             "| field | always | meaning |", "|---|---|---|"]
    lines += [f"| `{k}` | {'yes' if k in REQUIRED_FIELDS else ''} | {_cell(v)} |" for k, v in FIELDS.items()]
    lines += ["", "## summary.json", "", "Written by rank 0 at the end of a run from every rank's figures "
              "(summary.py `SUMMARY_FIELDS`).", "", "| key | meaning |", "|---|---|"]
    lines += [f"| `{k}` | {_cell(v)} |" for k, v in SUMMARY_FIELDS.items()]
    lines += ["", "### Each entry of `ranks`", "", "Indexed by global rank (summary.py `RANK_FIELDS`).", "",
              "| key | meaning |", "|---|---|"]
    lines += [f"| `{k}` | {_cell(v)} |" for k, v in RANK_FIELDS.items()]
    return "\n".join(lines) + "\n"


def schedules_page() -> str:
    from pipezero.schedules.registry import SCHEDULES

    rules = {"1": "1", ">=2": "2 or more", "==2": "exactly 2"}
    lines = ["# Schedule registry", "", GENERATED, "",
             "schedules/registry.py holds one entry a schedule; `train --schedule`, `simulate`, `plan` and the "
             "layout checks all read it. Actions: `F` forward, `B` input gradient, `W` weight gradient, "
             "`BW` both.", "",
             "| schedule | chunks a rank (V) | split backward (B, W) | what it is for |", "|---|---|---|---|"]
    for kind, info in SCHEDULES.items():
        lines.append(f"| `{kind.value}` | {rules[info.virtual]} | {'yes' if info.split_backward else 'no'} | "
                     f"{_cell(info.summary)} |")
    lines.append("")
    for kind, info in SCHEDULES.items():
        doc = inspect.getdoc(info.generator) or ""
        lines += [f"## `{kind.value}`", "", doc, ""]
    return "\n".join(lines) + "\n"


PAGES = {"reference/cli.md": cli_page, "reference/configuration.md": configuration_page,
         "reference/outputs.md": outputs_page, "reference/schedules.md": schedules_page}


def on_files(files: Any, config: Any) -> Any:
    """MkDocs hook: add the generated pages to the site's files before the navigation is built."""
    from mkdocs.structure.files import File

    for uri, page in PAGES.items():
        files.append(File.generated(config, uri, content=page()))
    return files
