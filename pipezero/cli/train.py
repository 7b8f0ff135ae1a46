"""`pipezero train`: a run's settings from flags and TOML, checked here before any rank starts, then
trained in this process or through the launcher (--nproc, torchrun, srun)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from pipezero.errors import ConfigError
from pipezero.cli.flags import add_train_flags, flag_values


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("train", allow_abbrev=False, help="train a model", description="Train a decoder LM; how it works: docs/ARCHITECTURE.md.")
    add_train_flags(t)
    add_auto_flags(t)
    t.add_argument("--force", action="store_true", help="train a new run in an --out that holds a run pipezero started (its .run-id or checkpoints), "
                        "replacing its metrics.jsonl, summary.json and trace; in a folder of files pipezero did not "
                        "write (no .run-id, no checkpoints) a run's names are refused, never replaced, and other "
                        "files are left beside the run")
    t.set_defaults(func=lambda args: cmd_train(args))  # looked up when run: the parser is built once


def add_auto_flags(parser: argparse.ArgumentParser) -> None:
    """`--layout auto` and what only it reads (pipezero/planner/auto.py); flags, not run settings:
    the run's config.json holds the layout chosen."""
    parser.add_argument("--layout", choices=("given", "auto"), default="given",
                        help="auto: measure this machine in the job (a few seconds) and train the layout the "
                             "planner predicts fastest within --gpu-memory (CPU: the host's memory a rank) on the "
                             "ranks started; layout flags given beside it are constraints (docs/tutorials/auto.md)")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="with --layout auto: sequences a step, the same for every layout weighed (default: "
                             "the settings' microbatches x micro-batch-size x dp)")
    parser.add_argument("--costs", metavar="FILE", default=None,
                        help="with --layout auto: choose from this probe (pipezero probe --json FILE) instead of "
                             "probing in the job")
    parser.add_argument("--layout-trials", type=int, default=None, metavar="K",
                        help="with --layout auto: train up to K layouts predicted within 15%% of the chosen one for "
                             "3 steps each in the job, in rounds (those within 25%% of a round's fastest again, while "
                             "a whole round fits 10%% of the run's predicted time; a run under 60 steps tries none) "
                             "and train the fastest measured; 0: the model's choice untried (default 3)")


def auto_settings(args: argparse.Namespace, settings: dict[str, Any], names: dict[str, str],
                  nproc: int | None, ranks: tuple[int, int] | None = None) -> tuple[dict[str, Any], Any, Any]:
    """With --layout auto: (the settings of the provisional choice, the request, that choice), the
    request refused in one line here, before any rank starts; else the settings as given."""
    if args.layout != "auto":
        for flag, value in (("--global-batch", args.global_batch), ("--costs", args.costs),
                            ("--layout-trials", args.layout_trials)):
            if value is not None:
                raise ConfigError(f"{flag} is read only with --layout auto: add --layout auto, or drop it")
        return settings, None, None
    from pipezero.planner.auto_job import provisional, request, settings_of

    req = request(args.config, settings, names, nproc, args.global_batch, args.costs, ranks, args.layout_trials)
    if req.costs is not None:
        from pipezero.planner.auto_refusals import shape_note
        from pipezero.rundir import HELD_BY_LAUNCHER

        once = os.environ.get("RANK", "0") == "0" and not os.environ.get(HELD_BY_LAUNCHER)  # the launcher, or rank 0
        if once and (note := shape_note(args.costs, req.costs, req.base)):
            print(f"pipezero: warning: {note}", file=sys.stderr, flush=True)
    first = provisional(req)
    return settings_of(req, first), req, first


def cmd_train(args: argparse.Namespace) -> int:
    from pipezero.settings import build_config, build_launch, check_launch

    settings, launch_values, names = flag_values(args)
    launch = build_launch(launch_values, names)
    if args.layout == "auto":
        from pipezero.launch import adopt_slurm

        adopt_slurm(launch.nproc)  # srun's ranks: the world size from Slurm's variables
    settings, auto, first = auto_settings(args, settings, names, launch.nproc)
    cfg = build_config(args.config, settings, names)
    check_launch(launch, cfg.parallel.world_size)
    from pipezero.memory.fit import check_fit, limit_name, rank_limit_gib

    local = local_ranks(launch.nproc, cfg.parallel.world_size)
    limit, cuda = rank_limit_gib(cfg, local)
    check_fit(cfg, limit, cuda, limit_name(cfg, local))  # before any rank starts: a layout that cannot fit is refused
    from pipezero.launch import (adopt_slurm, check_rendezvous_host, check_tokenizer_rows, check_world_size,
                                 exit_rank, launch_local, preflight, under_torchrun, with_device)

    adopt_slurm(launch.nproc)  # srun with one task a rank: torchrun's variables from Slurm's
    check_world_size(os.environ, cfg.parallel.pp, cfg.parallel.dp)
    check_rendezvous_host(os.environ)
    if not under_torchrun():  # a rank of a job (srun's, torchrun's) holds only its own
        check_host_memory(cfg, cuda)
    from pipezero.rundir import HELD_BY_LAUNCHER, Claim, claim_here

    restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if not restarts.isdigit():  # torchrun's, read as an integer by the claim and the resume: a traceback
        raise ConfigError(f"TORCHELASTIC_RESTART_COUNT={restarts[:80]!r} is not a count; it is torchrun's variable: "
                          f"unset it")
    if args.force and cfg.run.resume:  # resume won, and --force was read by nothing
        raise ConfigError("--force and --resume ask for opposite things (--force: a new run beside the one in --out; "
                          "--resume: continue that one): choose one")
    check_out(cfg)
    if cfg.model.pretrained is not None and not under_torchrun():  # once, not in every rank
        from pipezero.models.hf_weights import check_finite

        check_finite(cfg.model)

    launching = launch.nproc is not None and launch.nproc > 1 and not under_torchrun()
    if launching:
        device = preflight(cfg, launch.nproc)  # the ranks' device is decided here, once
    elif not under_torchrun():  # a lone process: before --out is claimed and the corpus tokenized
        check_tokenizer_rows(cfg)
    def clashes() -> str | None:
        from pipezero.checkpoint.state import clashes as beside

        return beside(cfg)

    with claim_here(cfg.run.out, cfg.run.resume, args.force, clashes) as held:
        args.claimed = cfg.run.out  # a lone process stopped by a signal says what this folder then holds
        if launching:
            return launch_local(launch.nproc, with_device(args.argv, device.value), cfg.run.out,
                                launch.max_restarts, {HELD_BY_LAUNCHER: "1"},
                                lock_fd=held.fd if isinstance(held, Claim) else None)
        choice, code, unfit = None, None, False
        if auto is not None:  # inside the job: probe, choose on rank 0, every rank trains its choice
            from pipezero.planner.auto_trials import TrialFailed
            from pipezero.probe import ProbeError

            try:
                cfg, choice = decided(auto, first, cfg, names)
            except ProbeError as e:  # nothing trained: the probe could not measure this machine
                print(f"pipezero: error: --layout auto: the probe in the job measured nothing usable: {e}; or give "
                      f"--costs FILE", file=sys.stderr, flush=True)
                code = 1
            except TrialFailed as e:  # nothing trained; every rank stops with the line
                print(f"pipezero: error: {e}", file=sys.stderr, flush=True)
                code, unfit = 1, True
        unprobed = code is not None
        if code is None:
            code = train_here(cfg, choice)
        if (code == 2 or unprobed) and isinstance(held, Claim):  # the user's spec raised, or nothing was
            held.drop_opening()  # measured to choose from: nothing of the run stays
    if under_torchrun():
        if unfit:  # the group has unmatched messages in flight: no teardown collective on it
            os._exit(code)
        exit_rank(code)
    return code


def decided(req: Any, first: Any, cfg: Any, names: dict[str, str]) -> tuple[Any, Any]:
    """The configuration of the layout chosen inside the job, and the choice (planner/auto_job.py)."""
    from pipezero.memory.fit import check_fit
    from pipezero.planner.auto_job import announce, decide, settings_of
    from pipezero.planner.auto_trials import settle_by_trials
    from pipezero.settings import build_config

    choice, probe_s = decide(req, first, cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        announce(choice, probe_s)
    choice = settle_by_trials(req, choice, cfg, names)  # near-ties measured here, the fastest first
    final = build_config(req.config, settings_of(req, choice), names)
    check_fit(final, req.limit_gib, req.cuda)  # as the provisional layout was, before any rank started
    return final, choice.to_json()


def local_ranks(nproc: int | None, world: int) -> int:
    """Ranks on this node: `--nproc`'s, or torchrun's LOCAL_WORLD_SIZE for a rank it started, or the
    layout's (one process of a one-rank run)."""
    from pipezero.launch import under_torchrun

    if nproc is not None:
        return nproc
    return int(os.environ.get("LOCAL_WORLD_SIZE") or world) if under_torchrun() else 1


def check_out(cfg: Any) -> None:
    """What train refuses about --out before any rank starts (a resume's clashes and problems, a
    link at OUT/hf); the claim checks the rest as it takes the folder."""
    from pipezero.launch import under_torchrun
    from pipezero.rundir import run_id

    kept = Path(cfg.run.out) / "hf"
    if cfg.model.pretrained is not None and kept.is_symlink():  # rewritten at each start, through the link
        raise ConfigError(f"--out {cfg.run.out!r}: hf is a symlink (to {os.readlink(kept)}), and the run rewrites the "
                          f"model's files there at each start, which would write over that folder's: remove the "
                          f"link (the run keeps its own copy)")
    if cfg.run.resume and not under_torchrun():  # another run's folder is named busy first: its steps are moving
        from pipezero.rundir import in_use

        in_use(cfg.run.out)
    if cfg.run.resume:  # a save replaces what is at its step: refuse here what the run did not write
        from pipezero.checkpoint.state import resume_clashes, resume_problem

        if clash := resume_clashes(cfg, run_id(cfg.run.out)):
            raise ConfigError(f"--out {cfg.run.out!r}: {clash}")
        if not under_torchrun() and (problem := resume_problem(cfg, run_id(cfg.run.out))):
            raise ConfigError(f"--resume in {cfg.run.out!r}: {problem}")


def check_host_memory(cfg: Any, cuda: bool = False) -> None:
    """The ranks started here share this host's memory (--host-memory, default this machine's): a
    run whose ranks need more was built for minutes before the kernel killed it (--preset 7b on a
    24 GiB host). Counted from the memory model (memory/model.py, memory/offload.py): each rank's host
    bytes (--offload optimizer's masters, moments and gradient staging) and, on CPU ranks, whose
    device is the host, their device peak too. A model of one's own is not predicted."""
    from pipezero.config import Offload

    offload = cfg.parallel.offload is not Offload.NONE
    if cfg.model.spec is not None or (cuda and not offload):
        return  # nothing of pipezero's own on a GPU rank's host without offload
    from pipezero.memory.model import predict
    from pipezero.memory.partition import resolve
    from pipezero.memory.offload import node_host_need

    gib = 2**30
    given = cfg.run.host_memory_gib
    host = given * gib if given is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    ranks = predict(resolve(cfg, cuda), cuda)  # cut as the ranks will cut it (--partition memory)
    need = node_host_need([r.host_peak_bytes for r in ranks], [r.peak_bytes for r in ranks], not cuda)
    if need <= host:
        return
    ranks_of = "1 rank's" if len(ranks) == 1 else f"{len(ranks)} ranks'"
    held = "host buffers of --offload optimizer: fp32 masters, AdamW moments, gradient staging"
    if cuda:
        whose = f"{ranks_of.replace('rank', 'GPU rank')} {held}"
    else:  # a CPU rank's whole peak is on the host, and with offload its host buffers beside it
        whose = (f"{ranks_of.replace('rank', 'CPU rank')} predicted peak{'' if len(ranks) == 1 else 's'}: weights, "
                 f"gradients, AdamW state, activations" + (f"; and their {held}" if offload else ""))
    limit = f"--host-memory {given:g} GiB" if given is not None else f"this host's {host / gib:.1f} GiB"
    fix = ("more host memory, ranks on more hosts, or with --dp > 1 --zero 1 or more (each rank offloads its shard, "
           "not every bucket)" if offload else "a smaller --preset or --model, or ranks on more hosts")
    size = f"{need / gib:.1f}" if need >= gib else f"{need / gib:.2g}"  # a small run's need is not "0.0"
    raise ConfigError(f"the run needs about {size} GiB ({whose}), more than {limit}: {fix}")


def train_here(cfg: Any, choice: Any = None) -> int:
    """Train as this process (alone or one rank); a failure the user can act on is one line, exit 1
    (exit 2: the user's own --model-spec code raised). `choice`: --layout auto's, checked against
    the steps measured (planner/auto_check.py)."""
    from pipezero.checkpoint import CheckpointError
    from pipezero.engine import train
    from pipezero.launch import under_torchrun
    from pipezero.nonfinite import TrainingDiverged
    from pipezero.parallel.waits import PipelineTimeout

    try:
        train(cfg) if choice is None else train(cfg, choice=choice)
    except (CheckpointError, TrainingDiverged, PipelineTimeout) as e:
        print(f"pipezero: error: {e}", file=sys.stderr, flush=True)
        if under_torchrun():
            os._exit(1)  # peers may be gone: no teardown collective
        return 1
    except Exception as e:  # noqa: BLE001 - said in one line only when it is no bug of pipezero's (failure_line)
        if (said := failure_line(cfg, e)) is None:
            raise
        code, line = said
        print(f"pipezero: error: {line}", file=sys.stderr, flush=True)
        if under_torchrun():
            os._exit(code)  # peers may be gone: no teardown collective
        return code
    return 0


def failure_line(cfg: Any, e: Exception) -> tuple[int, str] | None:
    """(exit code, line) for a training failure the user can act on; None for any other (its traceback):
    a write refused (a full disk, a read-only or immutable file), a process group whose connection
    failed, the user's --model-spec code raising (exit 2: its own line, as a refusal's)."""
    from pipezero.launch import under_torchrun
    from pipezero.slurm import rendezvous_advice
    from pipezero.files import refused_write

    if isinstance(e, OSError) and (refused := refused_write(e)) is not None:  # metrics, summary, tensorboard
        from pipezero.checkpoint.store import after_fixing
        from pipezero.rundir import run_id

        return 1, f"rank {os.environ.get('RANK', 0)}: {refused}; {after_fixing(Path(cfg.run.out) / 'checkpoints', run_id(cfg.run.out))}"
    # torch's DistNetworkError, DistStoreError (by name: torch 2.5 has no such API): a MASTER_ADDR that
    # resolves nowhere
    if isinstance(e, RuntimeError) and type(e).__name__ in ("DistNetworkError", "DistStoreError"):
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return 1, (f"rank {os.environ.get('RANK', 0)}: the process group's connection to "
                   f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')} failed "
                   f"({type(e).__name__}: {first}); {rendezvous_advice(os.environ)}")
    if cfg.model.spec is not None and (line := parts_out_of_order(cfg, e)) is not None:
        return 2, line
    if cfg.model.spec is not None:
        from pipezero.models.user_spec import users_fault

        if (fault := users_fault(cfg.model.spec, e)) is not None:  # each failing rank says it, named
            return 2, f"rank {os.environ.get('RANK', 0)}: {fault}" if under_torchrun() else str(fault)
    return None


def parts_out_of_order(cfg: Any, e: Exception) -> str | None:
    """The line for a spec's parts the runtime found in another order than its forward runs them
    (a layer the start-up check could not run: models/parts.py `forward_order`); None for any other
    failure. With the built-in model's parts the same error is a bug of ours (its traceback)."""
    from pipezero.config import Zero3Unit
    from pipezero.zero.gathering import UngatheredUse

    if not isinstance(e, UngatheredUse) or cfg.parallel.zero3_unit is not Zero3Unit.SUBLAYER:
        return None
    return (f"{e}: --model-spec {cfg.model.spec}'s layer_parts lists a layer's parts in another order than its "
            f"forward runs them; list the parts in the order they run, each part's modules one after another")

