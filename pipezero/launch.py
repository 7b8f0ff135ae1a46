"""`--nproc N`: start N local ranks through torch.distributed's own launcher (torchrun).

Under an outside `torchrun` (several machines, `--nnodes K --rdzv-backend c10d`) nothing is
launched: the ranks read RANK / WORLD_SIZE / MASTER_ADDR from the environment torchrun set. Under
`srun` with one task a rank, the same variables are taken from Slurm's first (slurm.py).
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Mapping, MutableMapping, Sequence

from pipezero.config import Device, TrainConfig
from pipezero.errors import ConfigError
from pipezero.job import run_job
from pipezero.slurm import (as_count, in_srun_step, master_from, master_named, rank_variables, start_ranks_advice,
                            step_tasks)


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def adopt_slurm(nproc: int | None, env: MutableMapping[str, str] = os.environ) -> None:
    """Make an srun task (one a rank) a rank as torchrun's would be, before anything reads RANK:
    the run folder's claim, the process group (env://), the device by LOCAL_RANK. Written into the
    process's environment because torch's env:// rendezvous reads it there. A `--nproc` launcher
    must be the step's only task, or every task would start its own copy of the job."""
    if nproc is not None and nproc > 1 and in_srun_step(env) and "TORCHELASTIC_RUN_ID" not in env:
        tasks = step_tasks(env)
        if tasks != 1:
            raise ConfigError(f"--nproc {nproc} inside an srun step of SLURM_NTASKS={tasks} tasks would start "
                              f"{tasks} jobs: drop --nproc (srun starts one task a rank) or run `srun --ntasks 1`")
    env.update(rank_variables(env))
    check_rank_variables(env)


def check_rank_variables(env: Mapping[str, str]) -> None:
    """RANK / WORLD_SIZE / LOCAL_RANK set by hand (or left over in a shell) are read by every
    later step as integers: text there fails deep inside torch, a rank past the world waits for a
    peer that never comes. Refused here, naming the variable."""
    if "RANK" not in env or "WORLD_SIZE" not in env:  # under_torchrun's test: otherwise none is read
        return
    values = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        text = env.get(name)
        if text is not None and not _ascii_count(text):
            raise ConfigError(f"{name}={text[:80]!r} is not a rank number; these are torchrun's variables: "
                              f"unset them, or set them to integers (RANK < WORLD_SIZE)")
        values[name] = None if text is None else int(text)
    if not 0 <= values["RANK"] < values["WORLD_SIZE"]:
        raise ConfigError(f"RANK={values['RANK']} is not a rank of WORLD_SIZE={values['WORLD_SIZE']}; these are "
                          f"torchrun's variables: unset them, or set RANK below WORLD_SIZE")
    port = env.get("MASTER_PORT", "")
    if values["WORLD_SIZE"] > 1 and not (env.get("MASTER_ADDR") and _ascii_count(port) and 1 <= int(port) <= 65535):
        # the env:// rendezvous reads them: unset, it raises a ValueError; a bad port, it waits on no port
        raise ConfigError(f"RANK and WORLD_SIZE={values['WORLD_SIZE']} are set by hand, but MASTER_ADDR={env.get('MASTER_ADDR', '')[:80]!r} "
                          f"MASTER_PORT={port[:80]!r} name no rendezvous: set both (a host and a port), or unset "
                          f"RANK and WORLD_SIZE and pass --nproc")


def _ascii_count(text: str) -> bool:
    """Digits 0-9 only: str.isdigit takes other scripts' digits too, which int() then reads."""
    try:
        as_count(text)
    except ValueError:
        return False
    return True


def check_world_size(env: Mapping[str, str], pp: int, dp: int) -> None:
    """The ranks started (WORLD_SIZE, an srun step's tasks) against the layout, before anything is
    claimed or joined; said with the fix for the launcher in use (inside a step --nproc is refused,
    and the step's task count is the fix)."""
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return
    world = int(env["WORLD_SIZE"])  # check_rank_variables read it as a count
    if world == pp * dp:
        return
    srun = in_srun_step(env) and "TORCHELASTIC_RUN_ID" not in env
    started = f"this srun step has {world} tasks (SLURM_NTASKS)" if srun else f"{world} were started (WORLD_SIZE)"
    raise ConfigError(f"--pp {pp} x --dp {dp} = {pp * dp} ranks, but {started}: {start_ranks_advice(env, pp * dp)}, "
                      f"or change --pp/--dp")


def check_rendezvous_host(env: Mapping[str, str]) -> None:
    """Resolve MASTER_ADDR before any rank waits on it: the env:// rendezvous retries a host that
    does not resolve until --timeout, then reports a timeout, not the name. Under torchrun's agent
    the rendezvous already happened (the agent resolved it)."""
    import socket

    if "TORCHELASTIC_RUN_ID" in env or "RANK" not in env or "WORLD_SIZE" not in env or not env.get("MASTER_ADDR"):
        return  # no env:// rendezvous of ours (check_rank_variables read RANK and WORLD_SIZE as counts)
    if int(env["WORLD_SIZE"]) < 2:
        return
    host = env["MASTER_ADDR"]
    try:
        socket.getaddrinfo(host, None)
    except (OSError, UnicodeError, ValueError) as e:  # gaierror; a label over 63 characters is a UnicodeError
        why = getattr(e, "strerror", None) or str(e) or type(e).__name__
        slurms = master_from(env) is not None
        fix = ("make the step's node names resolve on every node (DNS or /etc/hosts), or set MASTER_ADDR to "
               "rank 0's address" if slurms else "set it to rank 0's address (an IP or a name this node resolves)")
        raise ConfigError(f"{master_named(env)}{',' if slurms else ''} does not resolve on this node ({why}): the "
                          f"ranks would wait for it until --timeout; {fix}") from None


LAUNCHER_FLAGS = ("--nproc", "--max-restarts")  # the launcher's own: the ranks it starts never see them


def without_flags(argv: Sequence[str], flags: Sequence[str]) -> list[str]:
    """`argv` without `flags` and their values (`--flag VALUE` and `--flag=VALUE` alike)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        elif not a.startswith(tuple(f"{f}=" for f in flags)):
            out.append(a)
    return out


def with_device(argv: Sequence[str], device: str) -> list[str]:
    """`argv` with `--device DEVICE` in place of any the user gave: the launcher decides each rank's
    device (`auto` resolved, a GPU's ranks sharing it), and a rank's command line names one."""
    return [*without_flags(argv, ("--device",)), "--device", device]


def strip_launcher_flags(argv: Sequence[str]) -> list[str]:
    return without_flags(argv, LAUNCHER_FLAGS)


def preflight(cfg: TrainConfig, nproc: int, per_node: int | None = None) -> Device:
    """Refuse here, once, what every rank would refuse after torchrun started it (each printing
    the same line and torchrun adding its own report): data, tokenizer, vocabulary, devices, the
    split of the dp groups over nodes of `per_node` ranks (default: all `nproc` on this one); and
    decide the ranks' device (parallel/device.py `local_device`). The corpus is tokenized and
    cached here too, so the ranks only read the cache."""
    import torch

    from pipezero.data import load_corpus
    from pipezero.engine import check_corpus
    from pipezero.models import spec_of
    from pipezero.parallel.device import local_device
    from pipezero.stage import hierarchical_split_problem, secondary_split_problem

    for split_problem in (secondary_split_problem, hierarchical_split_problem):
        if problem := split_problem(cfg.parallel, cfg.parallel.ranks_per_node or per_node or nproc):
            raise ConfigError(problem)
    check_tokenizer_rows(cfg)
    corpus = load_corpus(cfg.data)
    check_corpus(cfg, corpus, spec_of(cfg.model).vocab_size)  # a --model-spec's own vocabulary
    from pipezero.checkpoint.state import check_resume_data

    if cfg.run.resume:  # a resume onto other data under the same names
        check_resume_data(cfg, corpus.record)
    device, warning = local_device(cfg.run.device, nproc, torch.cuda.device_count(), cfg.run.share_device)
    if warning:
        print(f"pipezero: warning: {warning}", file=sys.stderr, flush=True)
    return device


def check_tokenizer_rows(cfg: TrainConfig) -> None:
    """A tokenizer.json's ids against the model's embedding rows, as the file is loaded (a second):
    check_corpus holds them only after the corpus is tokenized, minutes for the built-in one."""
    if not cfg.data.tokenizer.endswith(".json"):  # bytes fits every model; a BPE is trained to bpe_vocab
        return
    from pipezero.data import load_tokenizer
    from pipezero.data.tokenizer import id_bound
    from pipezero.engine import check_rows
    from pipezero.models import spec_of

    check_rows(cfg, id_bound(load_tokenizer(cfg.data.tokenizer, [], cfg.data.bpe_vocab)), False,
               spec_of(cfg.model).vocab_size)


def exit_rank(code: int) -> None:
    """End a torchrun rank: tear the process group down, flush, and leave without interpreter
    teardown, where gloo's threads can abort an already finished run ("terminate called without
    an active exception", seen here at exit on CPU)."""
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.barrier()
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the run itself is complete; nothing left to save
            pass
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:  # closed (>&-) for the whole job: every rank inherits it
            stream.flush()
    os._exit(code)


# The agent and every rank start with no working folder on their import path: `python -m` would put it
# first, so a file there named like a module pipezero imports (rich.py, a corpus of .py documents) ran
# in every rank. Only --model-spec imports from the working folder, by its own choice (models/user_spec.py).
SAFE_PATH = {"PYTHONSAFEPATH": "1"}


def launch_local(nproc: int, argv: Sequence[str], out: str, max_restarts: int = 0,
                 extra_env: dict[str, str] | None = None, after_stop: str | None = None,
                 lock_fd: int | None = None) -> int:
    """Run `pipezero <argv>` on `nproc` ranks through torchrun, and return the job's exit code.
    The rendezvous is on 127.0.0.1 at a free port (runs never collide, and nothing listens beyond
    this machine: see loopback.py). With `max_restarts`, torchrun's elastic agent restarts every
    rank after one fails; they resume from the newest checkpoint (engine: a restarted worker
    always resumes). SIGINT/SIGTERM stop the whole job (job.py). `lock_fd`: the run folder's lock,
    held by every process of the job while it lives (lifeline.py)."""
    cmd = [sys.executable, "-P", "-m", "pipezero.loopback", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
           f"--rdzv-id={uuid.uuid4().hex}", "--nnodes=1", "--local-addr=127.0.0.1", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", "-m", "pipezero.cli", *strip_launcher_flags(argv)]
    env = {**os.environ, **(extra_env or {}), **SAFE_PATH}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    if sys.platform == "linux":
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's sockets on loopback too, whatever the hostname
    # glibc raises its mmap threshold after large frees, after which tensors freed by ZeRO (released
    # layers, reduced gradient buckets) stay in the heap and never leave the process; a fixed
    # threshold hands large blocks back to the OS, so sharding lowers resident memory on CPU too.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    return run_job(cmd, env, out, nproc, after_stop, lock_fd)
