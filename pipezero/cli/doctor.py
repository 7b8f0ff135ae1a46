"""`pipezero doctor RUN`: where every rank of a run stopped and which one holds the others up, read
from the flight records (pipezero/doctor.py), one line a rank and a verdict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipezero.doctor import report
from pipezero.flight_files import FOLDER, MAX_BYTES, RecordError, read_json


def add_doctor_parser(sub: Any) -> None:
    d = sub.add_parser("doctor", help="say where every rank of a run stopped and which one holds the others up",
                       description="Read RUN/doctor/ (the flight records ranks write when a wait stalls or fails, "
                                   "or when the launcher gets SIGUSR1) and print one line a rank and the verdict; "
                                   "exit 0 when records were found, 1 when none, 2 when a file there is not a "
                                   "record as a rank writes it (named, with why). Bounds: it reads records of "
                                   f"at most {MAX_BYTES >> 20} MiB, follows no link, and compiles one replica's "
                                   "programs of layouts train runs (P x D up to 65536 ranks, P x M x V up to 65536 "
                                   "stage micro-batches). See docs/how-to/hang-doctor.md.")
    d.add_argument("run", help="the run folder (--out of the run)")
    d.set_defaults(func=lambda args: cmd_doctor(args))  # looked up when run: the parser is built once


def _summary(out: Path) -> dict[str, Any] | None:
    """The run's summary.json for its straggler line, if there is a readable one (read as records are)."""
    try:
        summary = read_json(out / "summary.json")
    except RecordError:
        return None
    return summary if isinstance(summary, dict) else None


def cmd_doctor(args: Any) -> int:
    import sys

    out = Path(args.run)
    if not str(args.run).strip():  # Path("") is the working directory: "no flight records under doctor", exit 1
        print("pipezero doctor: the run folder is empty: pass the run's folder (its --out)", file=sys.stderr)
        return 2
    if not out.is_dir():  # not "no flight records under FILE/doctor"
        print(f"pipezero doctor: {out} {'is not a folder' if out.exists() else 'does not exist'}: pass the run's "
              f"folder (its --out)", file=sys.stderr)
        return 2
    if (out / FOLDER).exists() and not (out / FOLDER).is_dir():  # "no flight records", exit 1, named nothing wrong
        print(f"pipezero doctor: {out / FOLDER} is {'a file' if (out / FOLDER).is_file() else 'not a folder'}, where a "
              f"run keeps its flight records (a folder of rank-N.json): move it away, and the ranks write theirs "
              f"there when asked", file=sys.stderr)
        return 2
    summary = _summary(out)
    try:  # the records are data on disk: one a user edited or another tool wrote is one line, not a traceback
        text = report(out, summary)
        s = (summary or {}).get("straggler") if text is None else None
        tail = f"; straggler (summary.json): rank {s['rank']}, {s['s_per_step']:.3f}s a step" if s else ""
    except RecordError as e:
        print(f"pipezero doctor: {e}", file=sys.stderr)
        return 2
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        print(f"pipezero doctor: {out}'s flight records or summary.json are not as pipezero writes them "
              f"({type(e).__name__}: {e}); remove {out / FOLDER} and reproduce the hang to write fresh ones",
              file=sys.stderr)
        return 2
    if text is None:
        print(f"pipezero doctor: no flight records under {out / FOLDER}{tail}", file=sys.stderr)
        return 1
    print(text)
    return 0
