"""The `pipezero` command: one parser of every command, and what every command shares at its end: a
user's mistake is one line on stderr and exit status 2 (only bugs give tracebacks), standard output
that cannot be written is one line too, and Ctrl-C says how to go on."""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import re
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from pipezero.errors import ConfigError
from pipezero.cli.cluster import add_cluster_parser
from pipezero.cli.export import add_export_parser
from pipezero.cli.flags import OneLineParser
from pipezero.cli.probe import add_probe_parser
from pipezero.cli.train import add_train_parser
from pipezero.cli.verify import add_verify_parser


@functools.lru_cache(maxsize=1)
def build_parser() -> argparse.ArgumentParser:
    """Every command's parser, built once a process and only read after: parsing keeps nothing of a
    command line on the parser, and each command's `func` looks its handler up when it runs. A
    process that runs many commands (the tests: hundreds) built it 4-6 ms a command."""
    parser = OneLineParser(prog="pipezero", allow_abbrev=False, description="Pipeline parallelism + ZeRO training. "
                           "How it works: docs/ARCHITECTURE.md in the repository.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_parser(sub)
    add_verify_parser(sub)
    add_export_parser(sub)
    add_cluster_parser(sub, parser)
    from pipezero.cli.simulate import add_simulate_parser
    from pipezero.cli.plan import add_plan_parser

    add_simulate_parser(sub)
    add_plan_parser(sub)
    from pipezero.cli.doctor import add_doctor_parser

    add_doctor_parser(sub)
    add_probe_parser(sub)
    return parser


class OutputFailed(Exception):
    """Standard output could not take what a command printed (a full disk, a closed pipe). Not an
    OSError: a command's own handlers of its file writes (a checkpoint on a full disk) never take
    it for theirs, and no OSError of those is taken for this."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error.strerror or str(error))
        self.error = error


class GuardedOutput:
    """A stream (sys.stdout) whose failed writes and flushes raise OutputFailed; anything else is
    the stream's own."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            raise OutputFailed(e) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            raise OutputFailed(e) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


# commands whose result is what they print: with standard output closed, it would go nowhere, exit 0
PRINTS_ITS_RESULT = ("plan", "simulate", "doctor")
TRAINS = ("train", "verify")  # commands whose processes are ranks (or start them): SIGUSR1 is asked of them


def output_failed(e: OutputFailed, stream: Any) -> int:
    """A broken pipe (`pipezero plan | head`) ends quietly with the shell's status for SIGPIPE;
    any other failure is one line. Standard output is pointed at /dev/null, so the interpreter's
    own flush at exit finds nothing to fail on."""
    import errno

    if stream is sys.__stdout__:
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
        except (OSError, ValueError):
            pass
    from pipezero.launch import under_torchrun

    if under_torchrun():
        os._exit(2)  # a rank: peers may be gone, no teardown collective
    if e.error.errno == errno.EPIPE:
        return 128 + 13  # as if killed by SIGPIPE, as `yes | head` is
    print(f"pipezero: error: cannot write to standard output ({e}): free space where it goes, or redirect it "
          f"elsewhere", file=sys.stderr)
    return 2


NEGATIVE = re.compile(r"-\.?[0-9]")  # a value that starts as a negative number does: -1, -0.5, -1:1:1


def negative_values(argv: Sequence[str]) -> list[str]:
    """`--flag -1,2` as `--flag=-1,2`: argparse reads a value starting with '-' that is not a plain
    number (`--cost -1:1:1`) as the next option and answered "expected one argument", which hides
    the mistake; given to the flag, its own check names it."""
    out: list[str] = []
    for arg in argv:
        prev = out[-1] if out else ""
        if NEGATIVE.match(arg) and prev.startswith("--") and "=" not in prev and prev != "--":
            out[-1] = f"{prev}={arg}"
        else:
            out.append(arg)
    return out


RESUME = "; checkpoints are committed atomically, so --resume continues from the newest complete one"
INTERRUPTED = "pipezero: interrupted" + RESUME
TERMINATED = "pipezero: stopped by SIGTERM" + RESUME


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, `timeout`, a scheduler) or SIGHUP (a closed terminal or ssh session) in a lone
    process: stopped as Ctrl-C stops it, with its line, where the default action ended the run
    without a word (exit 143, 129)."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signum)
        self.signum = signum


def terminate(signum: int, frame: Any) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def sigterm_stops() -> Iterator[None]:
    """SIGTERM and SIGHUP (unless ignored: nohup) raise Terminated while the command runs, in a lone process's main thread; a rank of a
    job keeps the default (its launcher, torchrun or srun, stops it and says so)."""
    from pipezero.launch import under_torchrun

    if under_torchrun() or threading.current_thread() is not threading.main_thread():
        yield
        return
    from pipezero.job import stop_signals

    before = {sig: signal.signal(sig, terminate) for sig in stop_signals() if sig != signal.SIGINT}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def main(argv: Sequence[str] | None = None) -> int:
    from pipezero.lifeline import die_with_parent

    die_with_parent()  # a rank of pipezero's launcher: never outlive its torchrun agent
    with sigterm_stops():
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    argv = negative_values(sys.argv[1:] if argv is None else argv)
    saves = next((a for a in argv if not a.startswith("-")), "train") == "train"  # the only one with --resume
    try:
        parser = build_parser()  # imports torch: a second or more, the likeliest place for an early Ctrl-C
    except KeyboardInterrupt as e:
        return interrupted(e, saves)
    args = parser.parse_args(argv)
    args.argv = argv
    stream = sys.stdout
    if stream is None and args.command in PRINTS_ITS_RESULT:
        print(f"pipezero: error: standard output is closed, and pipezero {args.command} prints its result there: "
              f"redirect it to a file (> result.txt) or /dev/null", file=sys.stderr)
        return 2
    if stream is not None:
        sys.stdout = GuardedOutput(stream)  # type: ignore[assignment]
    from pipezero.runtime.watch import early_requests

    try:
        with early_requests(args.command in TRAINS):
            code = int(args.func(args) or 0)
        if sys.stdout is not None:  # closed (>&-): fine for a command that prints nothing it needs
            sys.stdout.flush()  # a full disk under the output shows here, not at the interpreter's exit
        return code
    except OutputFailed as e:
        return output_failed(e, stream)
    except ConfigError as e:
        print(f"pipezero: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        import errno

        from pipezero.files import refused_write

        if (refused := refused_write(e)) is not None:  # a full disk, a read-only or immutable file or folder
            print(f"pipezero: error: {refused}", file=sys.stderr)
            return 1
        if e.errno != errno.ENAMETOOLONG:  # any other is no input of the user's: its traceback
            raise
        name = str(e.filename or "")
        shown = name if len(name) <= 80 else f"{name[:40]}...{name[-20:]} ({len(name)} characters)"
        print(f"pipezero: error: the path {shown!r} is too long for this filesystem (File name too long): a name "
              f"holds at most {os.pathconf('/', 'PC_NAME_MAX')} bytes; give a shorter one", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM in a lone process (a --nproc launcher stops its job in job.py)
        return interrupted(e, saves, getattr(args, "claimed", None))
    finally:
        if stream is not None:
            sys.stdout = stream


def interrupted(e: KeyboardInterrupt, saves: bool = True, out: str | None = None) -> int:
    """The stop line and the shell's status for a signal's death: 128 + the signal. The resume
    advice only where the command `saves` checkpoints (train); where the run's folder `out` is known
    (claimed), what it holds says whether --resume has anything to continue from (job.py `stop_advice`)."""
    signum = e.signum if isinstance(e, Terminated) else signal.SIGINT
    line = INTERRUPTED if signum == signal.SIGINT else TERMINATED.replace("SIGTERM", signal.Signals(signum).name)
    if saves and out is not None:
        from pipezero.job import stop_advice

        line = f"{line.removesuffix(RESUME)}; {stop_advice(out)}"
    print(line if saves else line.removesuffix(RESUME), file=sys.stderr)
    return 128 + signum
