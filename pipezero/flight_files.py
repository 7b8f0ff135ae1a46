"""The flight records of a run on disk (`RUN/doctor/rank-NNNNN.json`, written by runtime/watch.py),
read as data that may be damaged, edited or planted: the hang doctor's verdict rests on them.

A record is trusted only when its file is a plain file inside the run folder (never a link: one to a
system file would be read as a rank's), of at most `MAX_BYTES` (a sparse file of a terabyte would be
a MemoryError), JSON nested no deeper than pipezero writes, with the fields and types a rank writes,
and named for the rank it says it is (a `rank` field of 0 in rank-00001.json replaced rank 0's real
record). Anything else is refused with the file named and why: shown as "no record", it would send
the user looking for a dead rank. The rename that writes each record (files.atomic_write_json) means
a reader never meets half of one, so no damage here is a race.

The plan a run's records are compiled against (the layout and the model's shapes, tens of KB) is
written once a run, beside them (`plan-RUN.json`): in each of a 65,536-rank run's records, it made
reading them take minutes. Records written before carry it themselves.
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FOLDER = "doctor"  # under the run folder
MAX_BYTES = 64 << 20  # a record is a few KB (with the plan inside, as older runs wrote, hundreds)
Record = dict[str, Any]

NAME = re.compile(r"rank-(\d{5,})\.json")
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # rundir's ids: 16 hex digits
NUMBER = (int, float)
# field -> the types a rank writes (runtime/flight.py `snapshot`, watch.py); those the doctor reads
FIELDS: dict[str, tuple[type, ...]] = {"rank": (int,), "written": NUMBER, "step": (int,), "index": (int,),
                                       "stage": (int,), "state": (str,), "instr": (str,), "waited_s": NUMBER}
OPTIONAL: dict[str, tuple[type, ...]] = {"awaited": (dict, type(None)), "nbytes": (int,), "unposted": (int,),
                                         "run": (str, type(None)), "plan": (dict,)}

LEAST = {"step": 0, "index": -1, "unposted": -1, "nbytes": 0}  # the least each whole-number field can be


class RecordError(ValueError):
    """A file under RUN/doctor the doctor cannot take as a rank's record: the file, and why."""


def record_path(out: str | Path, rank: int) -> Path:
    return Path(out) / FOLDER / f"rank-{rank:05d}.json"


def plan_path(out: str | Path, run: str | None) -> Path:
    """Where a run's plan lies beside its records (`run`: its id; None for a folder never claimed)."""
    return Path(out) / FOLDER / (f"plan-{run}.json" if run else "plan.json")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{f'{n:.1f}'.removesuffix('.0')} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def read_json(path: Path, max_bytes: int = MAX_BYTES) -> Any:
    """The JSON in file `path`, read without following a link, waiting on a pipe or reading more
    than `max_bytes`; RecordError says why not (in words that start with the file's name)."""
    name = path.name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if path.is_symlink():
            raise RecordError(f"{name} is a link (the doctor follows none: a rank writes its record as a file)") \
                from None
        raise RecordError(f"{name} cannot be read ({e.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise RecordError(f"{name} is not a plain file")
        if info.st_size > max_bytes:
            raise RecordError(f"{name} is {_size(info.st_size)}, past the {_size(max_bytes)} a record may be")
        data = b""
        while len(data) < info.st_size and (more := os.read(fd, min(max_bytes + 1, info.st_size + 1) - len(data))):
            data += more  # a regular file's read returns all asked for but at its end: once, nearly always
    except OSError as e:
        raise RecordError(f"{name} cannot be read ({e.strerror})") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # grew while read
        raise RecordError(f"{name} is past the {_size(max_bytes)} a record may be")
    try:
        return json.loads(data)
    except RecursionError:
        raise RecordError(f"{name} is nested deeper than a record is") from None
    except ValueError as e:
        raise RecordError(f"{name} is not JSON ({e})") from None


def _kinds(types: tuple[type, ...]) -> str:
    names = {int: "a whole number", float: "a number", str: "text", dict: "an object", type(None): "null"}
    return " or ".join(dict.fromkeys(names[t] for t in types))


def check_record(name: str, rec: Any) -> Record:
    """`rec` as read from file `name`, if it is a record as a rank writes it; RecordError else."""
    if not isinstance(rec, dict):
        raise RecordError(f"{name} holds no record (JSON {type(rec).__name__}, not an object)")
    for key, types in (*FIELDS.items(), *OPTIONAL.items()):
        if key not in rec:
            if key in FIELDS:
                raise RecordError(f'{name} misses "{key}"')
            continue
        value = rec[key]
        if type(value) not in types:  # bool is no number here: type(), not isinstance()
            raise RecordError(f'{name}\'s "{key}" is {json.dumps(value)[:40]}, not {_kinds(types)}')
    for key, least in LEAST.items():  # -1: outside the program (runtime/flight.py); nothing lower is written
        if key in rec and rec[key] < least:
            raise RecordError(f'{name}\'s "{key}" is {rec[key]}, not a whole number from {least}')
    if rec.get("awaited") is not None:
        _check_awaited(name, rec["awaited"])
    run = rec.get("run")
    if run is not None and not RUN_ID.fullmatch(run):
        raise RecordError(f'{name}\'s "run" {run[:40]!r} is no run id (letters, digits, ".", "_", "-")')
    named = NAME.fullmatch(name)
    if int(named.group(1)) != rec["rank"]:  # type: ignore[union-attr]
        raise RecordError(f"{name} says it is rank {rec['rank']} (a rank writes rank-{rec['rank']:05d}.json)")
    return rec


def _check_awaited(name: str, aw: dict[str, Any]) -> None:
    """What a rank waits for, as runtime/flight.py `awaiting` writes it: an op; a peer and a transfer
    (chunk, is a gradient, micro-batch) for a transfer; a chunk and maybe a bucket for a collective."""
    op = aw.get("op")
    if type(op) is not str:
        raise RecordError(f'{name}\'s "awaited" names no "op"')
    if op in ("RECV", "SEND"):
        t = aw.get("transfer")
        well = type(aw.get("peer")) is int and isinstance(t, list) and len(t) == 3 \
            and type(t[0]) is int and type(t[1]) in (bool, int) and type(t[2]) is int
        if not well:
            raise RecordError(f'{name}\'s "awaited" {op} wants a whole-number "peer" and "transfer" '
                              f'[chunk, is a gradient, micro-batch]')
    for key in ("chunk", "bucket"):
        if type(aw.get(key)) not in (int, type(None)):
            raise RecordError(f'{name}\'s "awaited" "{key}" is {json.dumps(aw[key])[:40]}, not a whole number')


@dataclass(frozen=True)
class RunRecords:
    """The newest run's records, by rank, and the plan they were written under."""

    records: dict[int, Record]
    plan: dict[str, Any]
    run: str | None


def check_folder(out: Path) -> Path:
    """RUN/doctor, if it lies inside the run folder (a link out of it is refused: RecordError)."""
    folder = out / FOLDER
    if folder.is_symlink():
        inside = os.path.realpath(folder).startswith(os.path.realpath(out) + os.sep)
        if not inside:
            raise RecordError(f"{folder} is a link out of the run folder (to {os.path.realpath(folder)}): the "
                              f"doctor reads records only inside it")
    return folder


def load_records(out: str | Path) -> dict[int, Record]:
    """Every record of the newest run that wrote any, by rank; RecordError names a file that is
    not a record as a rank writes it."""
    folder = check_folder(Path(out))
    found: dict[int, Record] = {}
    bad: list[str] = []
    for path in (folder / n for n in sorted(p.name for p in folder.glob("rank-*.json"))):  # names sort fast
        try:
            if not NAME.fullmatch(path.name):
                raise RecordError(f"{path.name} is not named for a rank (rank-NNNNN.json)")
            rec = check_record(path.name, read_json(path))
        except RecordError as e:
            bad.append(str(e))
            continue
        found[rec["rank"]] = rec
    if bad:
        raise RecordError(refusal(folder, bad))
    if not found:
        return {}
    newest = max(found.values(), key=lambda r: r["written"])
    return {r: rec for r, rec in found.items() if rec.get("run") == newest.get("run")}


def refusal(folder: Path, why: list[str]) -> str:
    """One line naming the files (the first three) and why the first is refused."""
    names = [w.split(" ", 1)[0].split("'s", 1)[0] for w in why]
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (f"{shown} under {folder} are not flight records as pipezero writes them ({why[0]}): remove them and "
            f"reproduce the hang to write fresh ones")


def read_run(out: str | Path) -> RunRecords | None:
    """The newest run's records and its plan; None without any record. RecordError: a file that is
    not a record, a record of a rank outside the plan's, or no plan to read."""
    records = load_records(out)
    if not records:
        return None
    newest = max(records.values(), key=lambda r: r["written"])
    run = newest.get("run")
    if "plan" in newest:  # written before plans were kept beside the records
        plan = newest["plan"]
    else:
        path = plan_path(out, run)
        try:
            plan = read_json(path)
        except RecordError as e:
            if not path.exists() and not path.is_symlink():
                raise RecordError(f"{path} is missing: the run's records are compiled against the plan its "
                                  f"ranks write there; reproduce the hang to write fresh ones") from None
            raise RecordError(refusal(path.parent, [str(e)])) from None
        if not isinstance(plan, dict):
            raise RecordError(refusal(path.parent, [f"{path.name} holds no plan"]))
    world = plan.get("pp", 0) * plan.get("dp", 0) if all(type(plan.get(k)) is int for k in ("pp", "dp")) else None
    if world is not None and world >= 1:  # sizes that are no layout: the plan's own check names them
        outside = [f"rank-{r:05d}.json names rank {r}, past the run's {world} ranks" for r in sorted(records)
                   if r >= world]
        if outside:
            raise RecordError(refusal(Path(out) / FOLDER, outside))
    return RunRecords(records, plan, run)
