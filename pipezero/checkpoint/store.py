"""Checkpoint folders on disk: complete or absent, checksummed, the newest N kept.

A checkpoint of step N is written by every rank into `.tmp-step-N/` (torch.distributed.checkpoint:
each rank its own files, in parallel). When all have finished, the ranks hash the files between
them, rank 0 writes `manifest.json` (step, layout, model, sha256 and size of every file) and
renames the folder to `step-N/` in one atomic step. So a folder named `step-N` with a manifest is
complete; anything else is debris of a crash and is never loaded. On resume, files are checked
against the manifest; a checkpoint that fails (truncated, bit-flipped, missing file) is reported
by name and the previous one is tried. The folder is assumed shared by all ranks (one machine, or
a shared filesystem across nodes).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from pipezero.files import atomic_write_json

FORMAT = "pipezero-checkpoint/1"
MANIFEST = "manifest.json"
_STEP = re.compile(r"^step-(\d{8})$")
_SCRATCH = re.compile(r"^\.(tmp|deleting)-step-\d{8}$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the rank, step and operation."""


def cause(e: BaseException) -> str:
    """One line saying what went wrong: DCP's CheckpointException prints every rank's traceback;
    keep each failed rank's exception instead."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException):
        return "; ".join(f"rank {r}: {cause(exc)}" for r, (exc, _) in sorted(e.failures.items())) or "unknown"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


@dataclass
class Team:
    """The ranks that write or read one checkpoint together (all of them), and how to say which
    rank failed at what. Without a process group it is one rank and every collective is a no-op."""

    rank: int = 0
    world: int = 1
    step: int = 0

    @classmethod
    def current(cls, step: int) -> "Team":
        if dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), step)
        return cls(0, 1, step)

    def run(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run one checkpoint operation (a DCP call or a collective); any failure, a timeout or a
        dead peer included, becomes a CheckpointError naming this rank, the step and `what`."""
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            with warnings.catch_warnings():  # DCP warns that one process means no process group: intended
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                return fn()
        except (Exception, CheckpointException) as e:  # timeouts, dead peers, DCP's own (a BaseException)
            if isinstance(e, CheckpointException) and any(isinstance(exc, KeyboardInterrupt)
                                                          for exc, _ in e.failures.values()):
                raise KeyboardInterrupt from e  # Ctrl-C in DCP's writer: the interrupt's line and 130, no failed save
            raise CheckpointError(f"rank {self.rank}, step {self.step}: checkpoint {what} failed: {cause(e)}") from e

    def barrier(self, what: str) -> None:
        if self.world > 1:
            self.run(what, dist.barrier)

    def gather(self, obj: Any, what: str) -> list[Any]:
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        self.run(what, lambda: dist.all_gather_object(out, obj))
        return out

    def share(self, obj: Any, what: str) -> Any:
        """Rank 0's `obj` on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        self.run(what, lambda: dist.broadcast_object_list(box, src=0))
        return box[0]


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def at_steps(root: Path) -> list[tuple[int, Path]]:
    """Everything named `step-N` under `root` (checkpoints, and whatever else a user put there),
    oldest first: a save of step N replaces what is at its name."""
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)))


def committed(root: Path) -> list[tuple[int, Path]]:
    """Committed checkpoints (a `step-N` folder with a manifest), oldest first."""
    return [(n, p) for n, p in at_steps(root) if (p / MANIFEST).is_file()]


def written_by(path: Path, run: str | None) -> bool:
    """Whether `path` is a checkpoint of run `run`, or of a run from before ids (as `latest` takes
    them): the only thing at `step-N` a save of that run may replace. Anything else (an export,
    a user's file, another run's checkpoint, one whose manifest cannot be read) it did not write."""
    if path.is_symlink() or not path.is_dir():
        return False
    try:
        return read_manifest(path).get("run") in (None, run)
    except CheckpointError:
        return False


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _hash_share(folder: Path, names: list[str], team: Team) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file, each rank hashing every world-th one."""
    mine = {n: {"bytes": (folder / n).stat().st_size, "sha256": _sha256(folder / n)}
            for n in names[team.rank::team.world]}
    merged: dict[str, dict[str, Any]] = {}
    for part in team.gather(mine, f"hashing of {folder.name}"):
        merged.update(part)
    return merged


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# What a save writes into a checkpoint's folder: DCP's shards and metadata, our manifest and its
# temporary file (files.atomic_write_with). Debris of a crash holds these only.
_SAVE_FILES = re.compile(r"^(__\d+_\d+\.distcp|(__\d+)?\.metadata(\.tmp)?|manifest\.json|\.manifest\.json\.[^/]*\.tmp)$")


class NotOurs(OSError):
    """A folder at one of a save's scratch names holds files no save writes: the user's, kept."""


def _strangers(path: Path) -> list[str]:
    """The entries of folder `path` that no save writes (a folder, a link, another name)."""
    try:
        return sorted(p.name for p in path.iterdir()
                      if not (_SAVE_FILES.match(p.name) and p.is_file() and not p.is_symlink()))
    except OSError:
        return []


def users_scratch(root: Path) -> list[Path]:
    """Folders at a save's scratch names under `root` (.tmp-step-N, .deleting-step-N) that hold
    files no save writes: a save or a prune would stop at them (NotOurs); said before training."""
    try:
        found = sorted(p for p in root.iterdir() if _SCRATCH.match(p.name))
    except OSError:
        return []
    return [p for p in found if p.is_dir() and not p.is_symlink() and _strangers(p)]


def _clear(path: Path) -> None:
    """Remove the debris at one of our scratch names (.tmp-step-N, .deleting-step-N). A link there
    goes, never what it points to: rmtree refuses a link, which stayed to fail the mkdir or rename
    after it in a traceback. A folder there that holds anything a save does not write is the user's
    (rmtree deleted it, notes and all): NotOurs, and it stays."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        if strangers := _strangers(path):
            shown = ", ".join(strangers[:3]) + (", ..." if len(strangers) > 3 else "")
            raise NotOurs(f"{path} holds {shown}, which no checkpoint save writes: move it out of {path.parent}")
        shutil.rmtree(path, ignore_errors=True)


def _discard(path: Path) -> None:
    """Remove a folder so that no half-deleted copy can ever look complete: rename, then delete."""
    if path.exists():
        doomed = path.with_name(f".deleting-{path.name}")
        _clear(doomed)
        path.rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def write(root: Path, step: int, state: dict[str, Any], info: dict[str, Any], keep: int, team: Team) -> Path:
    """Save `state` (a flat DCP state dict) as checkpoint `step` with `info` in its manifest, then
    keep only the newest `keep` checkpoints. Collective: every rank calls it."""
    import torch.distributed.checkpoint as dcp

    tmp, final = root / f".tmp-step-{step:08d}", step_dir(root, step)
    mine = team.rank != 0 or not (final.exists() or final.is_symlink()) or written_by(final, info.get("run"))
    if not team.share(mine, f"check of {final.name}"):  # every rank stops alike, before writing anything
        raise CheckpointError(f"rank {team.rank}, step {step}: {final} is not a checkpoint this run wrote, and a "
                              f"save replaces the folder of its step: move it out of {root}; "
                              f"{after_fixing(root, info.get('run'), 'move it')}")
    refused = None
    if team.rank == 0:
        try:
            _clear(tmp)  # debris of an earlier attempt at this step
            tmp.mkdir(parents=True)
        except OSError as e:  # a read-only or immutable folder, a full disk: every rank stops alike
            refused = _refused(e, root, info.get("run"))
    if refused := team.share(refused, f"start of step-{step:08d}"):
        raise CheckpointError(f"rank {team.rank}, step {step}: checkpoint {tmp} cannot be made: {refused}")
    try:
        team.run(f"write of {tmp}", lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp),
                                                     no_dist=team.world == 1))
        team.barrier(f"write of {tmp}")
        files = _hash_share(tmp, sorted(p.name for p in tmp.iterdir()), team)
    except CheckpointError as e:
        if team.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a failed save leaves nothing behind
        raise CheckpointError(_failed_write(e, root, info.get("run"))) from e
    if team.rank == 0:
        try:
            atomic_write_json(tmp / MANIFEST, {**info, "format": FORMAT, "step": step, "files": files})
            _fsync_dir(tmp)
            _discard(final)  # this run's checkpoint of this step that failed its checksum earlier
            tmp.rename(final)
            _fsync_dir(root)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            refused = _refused(e, root, info.get("run"))
        else:
            for old in prunable(root, info.get("run"), step)[:-keep] if keep > 0 else []:
                try:
                    _discard(old)
                except OSError as e:  # the new checkpoint is committed: an old one kept is no reason to stop
                    print(f"pipezero: warning: {old} was kept, past --keep-checkpoints {keep} "
                          f"({e.strerror or e}); remove it by hand", file=sys.stderr, flush=True)
    if refused := team.share(refused, f"commit of {final}"):
        raise CheckpointError(f"rank {team.rank}, step {step}: checkpoint {final} cannot be committed: {refused}")
    return final


def _refused(e: OSError, root: Path, run: str | None) -> str:
    """A filesystem's refusal of a checkpoint write as the fix; anything else is a bug: re-raised."""
    from pipezero.files import refused_write

    if isinstance(e, NotOurs):
        return f"{e}; {after_fixing(root, run, 'move it')}"
    if (said := refused_write(e)) is None:
        raise e
    return f"{said}; {after_fixing(root, run)}"


def after_fixing(root: Path, run: str | None, fix: str = "free space") -> str:
    """What to do once the cause of a failed save is fixed (`fix`, said when there is no checkpoint):
    --resume only where this run has a checkpoint to continue from (after its only save failed, the
    final one, --resume is refused: its records would be replaced by a start from step 0)."""
    own = own_checkpoints(root, run)
    if own:
        return f"then --resume continues from {own[-1].name}"
    return (f"this run has no earlier checkpoint to --resume from: {fix}, then train it again (--force in "
            f"this folder, or another --out)")


def free_bytes(folder: Path) -> int | None:
    """Bytes free to an unprivileged writer on the disk under `folder`; None when it cannot be asked."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


FULL_BELOW = 2**30  # a save that fails with less free than this is taken for a full disk


def _failed_write(e: CheckpointError, root: Path, run: str | None) -> str:
    """A failed DCP write as one line. A full disk fails it in torch's own words ('unexpected pos 704
    vs 598', from its zip writer, which drops the errno): said first as the full disk it is, with
    advice that works for this run; torch's words follow, for the record."""
    free = free_bytes(root)
    text = str(e)
    if "No space left" not in text and (free is None or free >= FULL_BELOW):
        return text
    shown = "" if free is None else f" ({free / 2**20:.1f} MiB free)"
    where, _, said = text.partition(": checkpoint ")
    return f"{where}: checkpoint not saved: the disk under {root} is full{shown} (checkpoint {said}); {after_fixing(root, run)}"


def run_of(path: Path) -> str | None:
    """The run id in checkpoint `path`'s manifest (None: written before runs had ids); raises
    CheckpointError when the manifest cannot be read."""
    return read_manifest(path).get("run")


def own_checkpoints(root: Path, run: str | None) -> list[Path]:
    """Committed checkpoints of run `run`, oldest first: the only ones its pruning may delete. One
    whose manifest cannot be read is nobody's, and is kept; so is a link (to a folder elsewhere)
    and a folder that holds a file its save did not write."""
    mine = []
    for _, path in committed(root):
        try:
            if not path.is_symlink() and run_of(path) == run and _only_its_files(path):
                mine.append(path)
        except (CheckpointError, OSError):
            continue
    return mine


def _only_its_files(path: Path) -> bool:
    """Whether checkpoint `path` holds only what its save wrote: a file its manifest does not list
    was put there by someone, and deleting the folder would delete it."""
    return {p.name for p in path.iterdir()} <= {MANIFEST, *read_manifest(path)["files"]}


def prunable(root: Path, run: str | None, step: int) -> list[Path]:
    """Checkpoints of run `run` up to `step` (the one just written), oldest first. Newer ones exist
    only when a resume skipped them as corrupt: counted among the newest N, they would push out the
    good checkpoint just written and leave only themselves. They are replaced when the run reaches
    their step."""
    return [p for p in own_checkpoints(root, run) if int(p.name.removeprefix("step-")) <= step]


def read_manifest(path: Path) -> dict[str, Any]:
    """Checkpoint `path`'s manifest, its fields checked: a manifest is data from disk, and nothing
    in it may point outside the folder or disagree with the folder's name. A save writes it as a
    file, so a link (planted, to a file elsewhere) is not followed."""
    if (path / MANIFEST).is_symlink():
        raise CheckpointError(f"{path}: {MANIFEST} is a symlink (to {os.readlink(path / MANIFEST)}), not the file a "
                              f"save writes")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: unreadable {MANIFEST}: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"{path}: format {got!r}, expected {FORMAT!r}")
    problem = _manifest_problem(path, manifest)
    if problem:
        raise CheckpointError(f"{path}: bad {MANIFEST}: {problem}")
    return manifest


def _manifest_problem(path: Path, m: dict[str, Any]) -> str | None:
    folder = _STEP.match(path.name)
    step, files = m.get("step"), m.get("files")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"step {step!r} is not a step number"
    if folder and int(folder.group(1)) != step:
        return f"step {step} but the folder is {path.name}"
    if not isinstance(files, dict) or not files:
        return "no files listed"
    for name, meta in files.items():
        if not name or "/" in name or "\\" in name or name in (".", "..") or Path(name).is_absolute():
            return f"file name {name!r} is not a plain name inside the checkpoint"
        if not (isinstance(meta, dict) and isinstance(meta.get("bytes"), int) and isinstance(meta.get("sha256"), str)):
            return f"file {name!r} lacks an integer size and a sha256"
    if "config" in m and not isinstance(m["config"], dict):
        return "config is not a dict"
    if "data" in m and not isinstance(m["data"], dict):
        return "data is not a dict"
    counts = {key: m[key] for key in ("world", "adam_steps", "bad_in_a_row") if key in m}
    if isinstance(m.get("data"), dict) and "samples" in m["data"]:  # read as numbers on resume: a str, a traceback
        counts["data.samples"] = m["data"]["samples"]
    for key, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:  # adam_steps < 0: NaN weights
            return f"{key} {value!r} is not a count"
    return None


def local_problem(path: Path) -> str | None:
    """What this rank alone can see wrong with checkpoint `path`: its manifest, missing files, sizes.
    A save writes a folder and plain files, so a link (planted, to files elsewhere) is not followed."""
    if path.is_symlink():
        return f"it is a link (to {os.readlink(path)}), not a folder a save writes"
    try:
        manifest = read_manifest(path)
    except CheckpointError as e:
        return str(e)
    expected: dict[str, dict[str, Any]] = manifest["files"]
    names = sorted(expected)
    linked = [n for n in names if (path / n).is_symlink()]
    if linked:
        return f"{linked[0]} is a link (to {os.readlink(path / linked[0])}), not a file a save writes"
    missing = [n for n in names if not (path / n).is_file()]
    if missing:
        return f"missing files {missing}"
    wrong_size = [n for n in names if (path / n).stat().st_size != expected[n]["bytes"]]
    if wrong_size:
        return f"files of the wrong size (truncated?): {wrong_size}"
    return None


def _agreed(path: Path, mine: str | None, team: Team) -> str | None:
    """Every rank's verdict on `path`, made one: the same on every rank, so all of them go on to the
    same collectives. A rank alone cannot skip a checkpoint the others load (it would wait on
    collectives of another checkpoint, or of training, until the timeout): ranks that disagree mean
    the folder is not one filesystem, which is one error naming the fix."""
    verdicts = team.gather(mine, f"check of {path.name}")
    bad = [(r, v) for r, v in enumerate(verdicts) if v is not None]
    if not bad:
        return None
    if len(bad) < len(verdicts):
        r, reason = bad[0]
        fine = next(q for q, v in enumerate(verdicts) if v is None)
        raise CheckpointError(f"{path}: rank {r} sees {reason}, while rank {fine} sees it complete: every rank "
                              f"must see the same checkpoint folder; put --out on a filesystem all nodes share")
    return bad[0][1]


def problems(path: Path, team: Team) -> str | None:
    """Why checkpoint `path` must not be loaded, or None when every file matches its manifest; the
    same answer on every rank (collective), or a CheckpointError when ranks see different folders."""
    reason = _agreed(path, local_problem(path), team)
    if reason is not None:
        return reason
    expected: dict[str, dict[str, Any]] = read_manifest(path)["files"]
    names = sorted(expected)
    actual = _hash_share(path, names, team)
    bad = [n for n in names if actual[n]["sha256"] != expected[n]["sha256"]]
    if bad:
        return f"checksum mismatch in {bad}"
    return _agreed(path, metadata_problem(path), team)


def metadata_problem(path: Path) -> str | None:
    """Whether checkpoint `path`'s metadata loads (and only metadata), and places every tensor
    inside a file its manifest lists: a shard cut short whose manifest was edited to match passes
    the checksums, and its read would end in an EOFError on every rank. Reads `.metadata` and sizes
    only (no tensor data): cheap enough for a preflight."""
    from torch.distributed.checkpoint.api import CheckpointException

    from pipezero.checkpoint.safe_reader import SafeReader

    try:
        meta = SafeReader(path).read_metadata()
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - any unreadable metadata: use another
        return f"unreadable checkpoint metadata: {cause(e)}"
    listed = read_manifest(path)["files"]
    ends: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if name not in listed or not all(isinstance(x, int) and x >= 0 for x in (offset, length)):
            return f"its metadata places a tensor in {name!r}, not a file its {MANIFEST} lists"
        ends[name] = max(ends.get(name, 0), offset + length)
    for name, end in sorted(ends.items()):
        size = (path / name).stat().st_size
        if size < end:
            return (f"shard {name} is cut short (it holds {size} bytes, its tensors reach byte {end}; the manifest "
                    f"was edited to match)")
    return None


@dataclass
class Found:
    path: Path
    manifest: dict[str, Any]
    skipped: list[tuple[Path, str]] = field(default_factory=list)  # newer checkpoints that failed


def latest(root: Path, team: Team, run: str | None = None) -> Found | None:
    """The newest checkpoint whose files match their manifest, warning (rank 0, stderr) about
    every newer one that does not; with `run`, only checkpoints of that run (or of no run).
    Collective: every rank calls it and gets the same answer."""
    candidates, run = team.share(([str(p) for _, p in committed(root)], run), "listing")
    skipped: list[tuple[Path, str]] = []
    for name in reversed(candidates):
        path = Path(name)
        reason = problems(path, team)
        if reason is None:
            manifest = read_manifest(path)
            if run is not None and manifest.get("run") not in (None, run):
                continue  # another run's, trained in this folder with --force
            return Found(path, manifest, skipped)
        skipped.append((path, reason))
        if team.rank == 0:
            print(f"pipezero: warning: skipping corrupt checkpoint {path}: {reason}; trying the previous one",
                  file=sys.stderr, flush=True)
    return None
