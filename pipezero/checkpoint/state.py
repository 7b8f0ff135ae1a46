"""A training run's state in a checkpoint, and back: what is saved, and how a run resumes.

Saved: every parameter and both AdamW moments, each rank its ZeRO shard's ranges (pieces.py), the
AdamW step count, the count of skipped non-finite steps in a row, each rank's torch RNG state, and
the configuration. Not saved, because it is a pure function of what is: the data position (the
batch of step s depends only on seed and s) and the learning rate (a function of the step). So a
checkpoint of step N restores exactly the state an uninterrupted run has after N steps, and a
different layout (P, D, ZeRO stage, V, schedule) reads the same names and ranges.

Frozen tensors (`--freeze`, freeze.py) are saved whole under their names, by the first data-parallel
rank of the stage that holds them (every replica holds them whole), with no optimizer entries; a
resume reads them whole on every rank. A run may freeze more than its checkpoint did (the extra
tensors' AdamW state is not read), but not less: a tensor frozen in the checkpoint has no state.

torch.distributed.checkpoint (and what builds on it: pieces.py, safe_reader.py) is imported by the
functions that save or load: its import (DTensor, sympy) costs each rank about 0.6 s of CPU, paid
only by runs that checkpoint.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipezero.checkpoint.store import (CheckpointError, Found, Team, at_steps, committed, latest, local_problem,
                                       metadata_problem, read_manifest, users_scratch, write, written_by)
from pipezero.config import TrainConfig
from pipezero.errors import ConfigError
from pipezero.freeze import frozen_names, shell_quoted
from pipezero.models.llama_spec import spec_of
from pipezero.models.spec import ModelSpec
from pipezero.rundir import run_id
from pipezero.zero.shard_state import restore_replicas, shard_state
from pipezero.zero.sharded import ZeroDP


def checkpoint_root(cfg: TrainConfig) -> Path:
    return Path(cfg.run.out) / "checkpoints"


def saves_after(cfg: TrainConfig, step: int) -> bool:
    """Whether a run of `cfg` saves a checkpoint after step `step` (1-based): every
    --checkpoint-every steps, and after the last unless --no-save-final (then the last only when it
    is a multiple of --checkpoint-every: the user asked for no final save)."""
    every, last = cfg.run.checkpoint_every, cfg.run.max_steps
    if step == last and cfg.run.save_final:
        return True
    return bool(every) and step <= last and step % every == 0


def saved_over(cfg: TrainConfig) -> list[Path]:
    """What sits at `checkpoints/step-N` for the steps a run of `cfg` saves: a save replaces it."""
    return [p for n, p in at_steps(checkpoint_root(cfg)) if saves_after(cfg, n)]


def _not_written(cfg: TrainConfig, paths: list[Path]) -> str:
    more = f" (and {len(paths) - 1} more)" if len(paths) > 1 else ""
    return (f"{paths[0]} is not a checkpoint this run wrote{more}, and this run saves that step (--checkpoint-every "
            f"{cfg.run.checkpoint_every}, --max-steps {cfg.run.max_steps}), which would replace it: move it away, "
            f"or choose another --out")


def clashes(cfg: TrainConfig) -> str | None:
    """For a new run (`--force`) beside another in the same folder: the other run's checkpoints, or
    anything else, this one would replace, saving the same steps, as one line naming the fix; None
    if none."""
    there = saved_over(cfg)
    theirs = {p for _, p in committed(checkpoint_root(cfg))}
    if foreign := [p for p in there if p not in theirs]:
        return _not_written(cfg, foreign)
    if held := _scratch_held(cfg):
        return held
    if not there:
        return None
    shown = ", ".join(p.name for p in there[:3]) + (", ..." if len(there) > 3 else "")
    return (f"--force would write over the checkpoints of the run there ({shown}), saving the same steps "
            f"(--checkpoint-every {cfg.run.checkpoint_every}, --max-steps {cfg.run.max_steps}): choose another "
            f"--out, --resume that run, or remove them")


def resume_clashes(cfg: TrainConfig, run: str | None) -> str | None:
    """For a resumed run `run`: what it would replace at the steps it saves that it did not write (an
    export put there, a user's file, another run's checkpoint), as one line naming the fix; None if
    nothing. A save refuses these too (store.write), but only after training up to it."""
    foreign = [p for p in saved_over(cfg) if not written_by(p, run)]
    return _not_written(cfg, foreign) if foreign else _scratch_held(cfg)


def _scratch_held(cfg: TrainConfig) -> str | None:
    """A folder of the user's at a save's scratch name (.tmp-step-N, .deleting-step-N): a save
    cleared it as debris of a crash, the user's files with it. Now kept, and said before training."""
    if not (held := users_scratch(checkpoint_root(cfg))):
        return None
    more = f" (and {len(held) - 1} more)" if len(held) > 1 else ""
    return (f"{held[0]}{more} holds files no checkpoint save writes, at the name a save or a prune of this run "
            f"uses for its scratch: move it out of {held[0].parent}")


def tied_aliases(tied: tuple[str, str] | None, held: dict[str, nn.Parameter],
                 shared: set[nn.Parameter]) -> dict[str, list[str]]:
    """With tied embeddings (the spec's two names) in one chunk, one parameter is both ends, named
    once; a pipeline holds two equal copies under two names, each saved by the rank that holds it.
    Saving the one parameter under both names keeps checkpoints the same whatever the layout. A
    rank that holds only the embedding's copy must not: its shard ranges of the head's name would
    overlap the head rank's, which DCP refuses to save."""
    if tied and tied[0] in held and tied[1] not in held and held[tied[0]] in shared:
        return {tied[0]: [tied[1]]}
    return {}


def state_dict(zero: ZeroDP, tied: tuple[str, str] | None, saving: bool,
               frozen: Sequence[tuple[str, nn.Parameter]] = ()) -> dict[str, Any]:
    """This rank's checkpoint entries, as pieces viewing its shards (`model.<name>`,
    `optim.exp_avg.<name>`, `optim.exp_avg_sq.<name>`), and its `frozen` tensors whole."""
    from pipezero.checkpoint.pieces import Piece, owned_ranges

    out = frozen_state(zero, tied, saving, frozen)
    held = {n: q for b in zero.all_buckets() for n, q in zip(b.names, b.params)}
    aliases = tied_aliases(tied, held, zero.shared) if saving else {}
    for b, tensors in shard_state(zero):
        for o in owned_ranges(b.names, b.offsets, [q.numel() for q in b.params], b.shard):
            for kind, flat in tensors.items():
                local = flat[o.at:o.at + o.hi - o.lo]
                for name in (o.name, *aliases.get(o.name, ())):
                    out[f"{kind}.{name}"] = Piece(o.numel, o.lo, local)
    return out


def frozen_state(zero: ZeroDP, tied: tuple[str, str] | None, saving: bool,
                 frozen: Sequence[tuple[str, nn.Parameter]]) -> dict[str, Any]:
    """`model.<name>` of each frozen tensor, whole: written once per stage (its first data-parallel
    rank; the replicas are equal), read by every rank."""
    from pipezero.checkpoint.pieces import Piece

    if saving and zero.dp_rank != 0:
        return {}
    aliases = tied_aliases(tied, dict(frozen), zero.shared) if saving else {}
    out: dict[str, Any] = {}
    for name, q in frozen:
        flat = q.detach().view(-1)
        for alias in (name, *aliases.get(name, ())):
            out[f"model.{alias}"] = Piece(flat.numel(), 0, flat)
    return out


def check_frozen(found: Found, cfg: TrainConfig, spec: ModelSpec | None = None) -> None:
    """Refuse to train a tensor the checkpoint froze: it has no AdamW state to resume."""
    if problem := thawed_problem(found.manifest, cfg, spec):
        raise CheckpointError(f"{found.path} {problem}")


def thawed_problem(manifest: dict[str, Any], cfg: TrainConfig, spec: ModelSpec | None = None) -> str | None:
    """Why resuming the checkpoint of `manifest` would train a tensor it froze, or None; the pattern
    quoted for a shell (freeze.shell_quoted), so the fix can be pasted as it is."""
    saved = (manifest.get("config") or {}).get("optim", {}).get("freeze")
    if not isinstance(saved, str):
        return None
    model = spec or cfg.model
    thawed = sorted(frozen_names(model, saved) - frozen_names(model, cfg.optim.freeze))
    if not thawed:
        return None
    return (f"was trained with --freeze {shell_quoted(saved)}; this run trains {len(thawed)} of those tensors "
            f"({', '.join(thawed[:3])}{', ...' if len(thawed) > 3 else ''}), which have no optimizer state there: "
            f"resume with --freeze {shell_quoted(saved)} (or one freezing more), or start a new --out")


def save(cfg: TrainConfig, zero: ZeroDP, step: int, bad_in_a_row: int, data: dict[str, Any] | None = None,
         frozen: Sequence[tuple[str, nn.Parameter]] = (), spec: ModelSpec | None = None) -> Path:
    """Checkpoint after `step` optimizer steps (collective); `data`: the data position (samples read);
    `frozen`: this rank's frozen tensors (freeze.frozen_params); `spec`: the model, when not cfg.model's."""
    team = Team.current(step)
    state = state_dict(zero, spec_of(spec or cfg.model).tied_names(), saving=True, frozen=frozen)
    check_finite(state, team, cfg.optim.lr)
    state[f"rng.rank{team.rank}"] = torch.get_rng_state()
    p = cfg.parallel
    info = {"config": cfg.to_dict(), "run": run_id(cfg.run.out), "world": team.world, "adam_steps": zero.opt.step_count,
            "bad_in_a_row": bad_in_a_row, "data": data or {},
            "layout": {"pp": p.pp, "dp": p.dp, "zero": p.zero, "virtual_stages": p.virtual_stages,
                       "schedule": p.schedule.value}}
    return write(checkpoint_root(cfg), step, state, info, cfg.run.keep_checkpoints, team)


def nonfinite_entries(state: dict[str, Any]) -> list[str]:
    """The names of `state`'s floating-point entries (weights, AdamW moments) holding NaN or inf."""
    bad = []
    for name, value in state.items():
        t = getattr(value, "_local", value)  # a Piece's own elements
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad.append(name)
    return bad


def check_finite(state: dict[str, Any], team: Team, lr: float) -> None:
    """Refuse, on every rank alike (collective), to save weights or optimizer state that are NaN
    or inf: an update that overflowed (--lr 1e308) left every weight NaN, saved as the run's final
    checkpoint with exit 0, and a resume or an export took it for the trained model. The earlier
    checkpoints stay (nothing is written or pruned)."""
    bad = sorted({n for part in team.gather(nonfinite_entries(state), "check that the state is finite") for n in part})
    if bad:
        shown = ", ".join(bad[:2]) + (f" and {len(bad) - 2} more" if len(bad) > 2 else "")
        raise CheckpointError(f"step {team.step}: checkpoint not saved: {shown} hold NaN or inf (an update diverged); "
                              f"the earlier checkpoints are kept: lower --lr (now {lr:g}) and start again, or "
                              f"--resume from the last good one")


def model_diff(saved: Any, now: dict[str, Any]) -> dict[str, Any]:
    """The [model] settings a checkpoint (`saved`) and this run (`now`) disagree on, as saved vs
    now. The --model folder's path is not one: the weights come from the checkpoint, the shape is
    compared field by field, and the same folder named from another working directory ('base',
    '/data/base') refused a resume."""
    if not isinstance(saved, dict):
        return {"[model]": (saved, "a table")}
    keys = (set(saved) | set(now)) - {"pretrained"}
    return {k: (saved.get(k), now.get(k)) for k in sorted(keys) if saved.get(k) != now.get(k)}


def finished(out: Path, newest: Path) -> bool:
    """Whether the run in `out` wrote its summary.json (its end) after its newest checkpoint `newest`:
    a resume at that step would train nothing and rewrite its records. A run that saved its last
    step but died before its summary is not finished: resuming it evaluates and writes the summary
    (an older summary.json beside it is an earlier run's, before --force)."""
    try:
        return (out / "summary.json").stat().st_mtime >= newest.stat().st_mtime
    except OSError:
        return False


def resume_problem(cfg: TrainConfig, run: str | None) -> str | None:
    """Why `--resume` in `cfg.run.out` (claimed by run `run`) would not continue its checkpoints,
    from their manifests alone, before any rank starts; None when it would (or there are none).
    Said by the ranks only as they loaded (exit 1), or not at all: a missing or damaged .run-id made
    the resume take none of the run's checkpoints and train from step 0, exit 0."""
    manifests = []
    for _, path in reversed(committed(checkpoint_root(cfg))):
        try:
            manifests.append((path, read_manifest(path)))
        except CheckpointError:
            continue  # a damaged one: the ranks skip it, naming it
    ids = {m.get("run") for _, m in manifests}
    if manifests and run is None and None not in ids:
        theirs = manifests[0][1]["run"]
        return (f"its .run-id is missing or damaged, so --resume would take none of its checkpoints (run {theirs!r} "
                f"wrote them) and train from step 0: write that id back, printf '{theirs}\\n' > "
                f"{Path(cfg.run.out) / '.run-id'}, or train in another --out")
    mine = [(p, m) for p, m in manifests if m.get("run") in (None, run)]
    usable = [(p, m) for p, m in mine if local_problem(p) is None]  # sizes and names: cheap, as the ranks see them
    if not usable and run is not None and (kept := run_records(Path(cfg.run.out))):  # no .run-id: the claim says it
        what = (f"every checkpoint of this run is damaged (newest {mine[0][0].name}: {local_problem(mine[0][0])})"
                if mine else "it holds no checkpoint of this run to continue from")
        return (f"{what}, but it holds {', '.join(kept)}, which a resume from step 0 would replace: restore the "
                f"checkpoint, move them away (or pass --force, without --resume, to start a new run there that "
                f"replaces them), or choose another --out")
    if usable and (short := metadata_problem(usable[0][0])):
        return (f"its newest checkpoint {usable[0][0]} is damaged: {short}; the ranks would fail reading it. Move "
                f"that step folder away to resume from the one before, or restore the file")
    if usable and usable[0][1]["step"] == cfg.run.max_steps and finished(Path(cfg.run.out), usable[0][0]):
        return (f"the run is complete: its newest checkpoint is of its last step, {cfg.run.max_steps}, and its "
                f"summary.json is written, so nothing would train and its records would be rewritten: raise "
                f"--max-steps above {cfg.run.max_steps} to train on, or export that checkpoint")
    if usable and usable[0][1]["step"] > cfg.run.max_steps:  # else "resumed", nothing trained, exit 0
        return (f"its newest checkpoint is of step {usable[0][1]['step']}, past --max-steps {cfg.run.max_steps}, so "
                f"nothing would train: raise --max-steps above {usable[0][1]['step']} to train on, or export that "
                f"checkpoint")
    if mine and (diff := model_diff((mine[0][1].get("config") or {}).get("model"), cfg.to_dict()["model"])):
        return (f"{mine[0][0]} holds a different model (saved vs now: {diff}); resume with the same model settings "
                f"(--preset, --model, [model]), or start a new --out")
    if usable and (thawed := thawed_problem(usable[0][1], cfg)):  # the checkpoint the ranks would load
        return f"{usable[0][0]} {thawed}"
    if usable and (refused := early_data_refusal(cfg, usable[0][1].get("data") or {}, usable[0][0])):
        return refused
    return None


def early_data_refusal(cfg: TrainConfig, saved: dict[str, Any], path: Path) -> str | None:
    """`data_refusal`'s tokenizer half, from the checkpoint's manifest and the tokenizer's file alone:
    said before any text is tokenized with the new tokenizer (minutes for the built-in corpus)."""
    from pipezero.data.identity import tokenizer_change

    if problem := tokenizer_change(saved, cfg.data.tokenizer):
        return (f"{path}: {problem}, so its steps would go on with other data: resume with the data "
                f"and tokenizer it trained on, or start a new --out for the new data")
    return None


# what a run writes at the top of --out that holds its results: a start from step 0 replaces them
RECORDS = ("metrics.jsonl", "summary.json", "trace.json", "trace.png")


def run_records(out: Path) -> list[str]:
    """Which of a run's records `out` holds with something in them (an empty metrics.jsonl is what a
    run that failed at its start leaves: nothing to lose)."""
    kept = []
    for name in RECORDS:
        try:
            if (out / name).stat().st_size > 0:
                kept.append(name)
        except OSError:
            continue
    return kept


def load(found: Found, cfg: TrainConfig, zero: ZeroDP, frozen: Sequence[tuple[str, nn.Parameter]] = (),
         spec: ModelSpec | None = None) -> None:
    """Fill this rank's shards and frozen tensors from checkpoint `found`, whatever layout wrote it
    (collective)."""
    import torch.distributed.checkpoint as dcp

    from pipezero.checkpoint.safe_reader import SafeReader

    m = found.manifest
    team = Team.current(m["step"])
    now = cfg.to_dict()
    if diff := model_diff(m["config"].get("model"), now["model"]):
        raise CheckpointError(f"{found.path} holds a different model (saved vs now: {diff}); train with the "
                              f"same [model] settings or start a new --out")
    check_frozen(found, cfg, spec)  # the same answer on every rank: it reads the two configurations only
    if team.rank == 0:
        warn_changed(m["config"], now, found.path)
    state = state_dict(zero, spec_of(spec or cfg.model).tied_names(), saving=False, frozen=frozen)
    same_ranks = m["world"] == team.world
    if same_ranks:  # torch RNG streams belong to ranks; after a reshard they start from the seed
        state[f"rng.rank{team.rank}"] = torch.empty_like(torch.get_rng_state())
    team.run(f"read of {found.path}", lambda: dcp.load(state, storage_reader=SafeReader(found.path),
                                                       no_dist=team.world == 1))
    if same_ranks:
        torch.set_rng_state(state[f"rng.rank{team.rank}"])
    restore_replicas(zero, m["adam_steps"])


# Settings that change what the resumed steps compute (the layout may change freely).
TRAINING_KEYS = {"optim": None, "data": ("path", "tokenizer", "bpe_vocab", "seq_len", "heldout_fraction", "max_bytes"),
                 "run": ("max_steps", "seed")}


def warn_changed(saved: dict[str, Any], now: dict[str, Any], path: Path) -> None:
    """A resumed run with other data, optimizer or schedule length is legitimate (fine-tuning,
    a longer run) but no longer reproduces the original: say so instead of doing it silently."""
    changed = [f"{section}.{k}: {saved[section].get(k)!r} -> {now[section].get(k)!r}"
               for section, keys in TRAINING_KEYS.items()
               for k in (keys or now[section]) if saved[section].get(k) != now[section].get(k)]
    if saved["parallel"]["microbatches"] * saved["parallel"]["micro_batch_size"] * saved["parallel"]["dp"] != \
            now["parallel"]["microbatches"] * now["parallel"]["micro_batch_size"] * now["parallel"]["dp"]:
        changed.append("global batch (microbatches x micro_batch_size x dp)")
    if (saved.get("model") or {}).get("pretrained") != now["model"].get("pretrained"):
        changed.append(f"model.pretrained: {saved['model'].get('pretrained')!r} -> {now['model'].get('pretrained')!r}")
    if changed:
        print(f"pipezero: warning: resuming {path} with changed settings, the run will differ from the "
              f"original: {'; '.join(changed)}", file=sys.stderr, flush=True)


def restarted() -> bool:
    """True in a worker that torchrun's elastic agent started again after a failure."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def data_refusal(cfg: TrainConfig, saved: dict[str, Any], now: dict[str, Any], path: Path) -> str | None:
    """Why checkpoint `path` (its manifest's "data": `saved`) cannot go on with the data this start
    reads (`now`, data/identity.py): its steps would continue on other tokens, under the same
    names; None when it can."""
    from pipezero.data.identity import data_change

    flag = f"--data {' '.join(cfg.data.path)}" if cfg.data.path else "the built-in corpus"
    if problem := data_change(saved, now, flag):
        return (f"--resume from {path}: {problem}, so its steps would go on with other data: resume with the data "
                f"and tokenizer it trained on, or start a new --out for the new data")
    return None


def check_resume_data(cfg: TrainConfig, now: dict[str, Any]) -> None:
    """`data_refusal` of the checkpoint a --resume would load, said once by the launcher (which
    has tokenized the corpus) before any rank starts; the ranks say it again as they load."""
    run = run_id(cfg.run.out)
    for _, path in reversed(committed(checkpoint_root(cfg))):
        try:
            m = read_manifest(path)
        except CheckpointError:
            continue  # a damaged one: the ranks skip it, naming it
        if m.get("run") in (None, run) and local_problem(path) is None:
            if refused := data_refusal(cfg, m.get("data") or {}, now, path):
                raise ConfigError(refused)
            return


def resume(cfg: TrainConfig, zero: ZeroDP, frozen: Sequence[tuple[str, nn.Parameter]] = (),
           spec: ModelSpec | None = None, data: dict[str, Any] | None = None) -> Found | None:
    """Load the newest good checkpoint when asked to resume or restarted by torchrun, and say
    which (its manifest holds the step to continue from); None when there is none to load."""
    if not (cfg.run.resume or restarted()):
        return None
    team = Team.current(0)
    run = run_id(cfg.run.out)
    found = latest(checkpoint_root(cfg), team, run)
    if found is None and (kept := run_records(Path(cfg.run.out))) and any(
            written_by(p, run) for _, p in committed(checkpoint_root(cfg))):  # all damaged (a checksum, ...)
        raise CheckpointError(f"every checkpoint of this run under {checkpoint_root(cfg)} is damaged (each named "
                              f"above), and a start from step 0 would replace {', '.join(kept)}: restore one, or move "
                              f"them away and --resume again")
    if found is None:
        if team.rank == 0:
            print(f"pipezero: no complete checkpoint under {checkpoint_root(cfg)}; starting at step 0",
                  file=sys.stderr, flush=True)
        return None
    if data is not None and (refused := data_refusal(cfg, found.manifest.get("data") or {}, data, found.path)):
        raise ConfigError(refused)  # every rank reads the same corpus: each refuses alike, before any collective
    load(found, cfg, zero, frozen, spec)
    if team.rank == 0:
        print(f"pipezero: resumed from {found.path} (step {found.manifest['step']})", file=sys.stderr, flush=True)
    return found
