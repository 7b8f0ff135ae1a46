"""The `pipezero` command line: one module a command (train, verify, export, cluster, simulate and its
--memory, plan, probe, doctor), `flags` for the run settings they share, `main` for the parser and
what every command does at its end. The reference pages of the documentation are generated from the
parser (`main.build_parser`)."""

from pipezero.cli.command_line import main

__all__ = ["main"]
