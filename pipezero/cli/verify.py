"""`pipezero verify`: a layout trained beside one process, every rank's losses, gradient norms and
weights compared within float tolerance."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipezero.errors import ConfigError
from pipezero.cli.flags import flag_values
from pipezero.cli.train import check_host_memory


def add_verify_parser(sub: argparse._SubParsersAction) -> None:
    """`verify` takes every `train` flag (the same parser's arguments) plus `--steps`."""
    v = sub.add_parser("verify", parents=[sub.choices["train"]], add_help=False,
                       help="check that a layout trains the same model as one process",
                       description="Run K steps of a layout and of one process (pp=1, dp=1) and compare losses, "
                                   "gradient norms and every rank's parameters, beside one process trained again "
                                   "with its batch cut another way (the rounding at this learning rate); exit 0 "
                                   "within tolerance, else 1. See docs/how-to/verify.md.")
    v.add_argument("--steps", type=int, default=3, help="optimizer steps to compare (default 3, at most 1000)")
    v.set_defaults(func=lambda args: cmd_verify(args))  # looked up when run: the parser is built once


# train's settings verify decides itself (verify.layout_config) or has no use for: given, they would
# be ignored without a word
VERIFY_SETS = ("run.max_steps", "run.resume", "run.checkpoint_every", "run.keep_checkpoints", "run.save_final",
               "run.eval_every", "run.sample_tokens", "launch.max_restarts")


def cmd_verify(args: argparse.Namespace) -> int:
    from pipezero.coerce import coerce
    from pipezero.launch import under_torchrun
    from pipezero.settings import build_config, build_launch
    from pipezero.memory.fit import rank_limit_gib
    from pipezero.schedules.limits import VERIFY_STEPS
    from pipezero.verify import verify_layout

    coerce("--steps", int, args.steps, False, VERIFY_STEPS)  # 10^11 trained three runs for ever
    settings, launch_values, names = flag_values(args)
    if args.layout == "auto" or args.global_batch is not None or args.costs is not None:
        raise ConfigError("pipezero verify checks a layout you name: run train --layout auto, then verify with the "
                          "flags it printed for its choice")
    ignored = [names[k] for k in (*settings, *launch_values) if k in VERIFY_SETS] + (["--force"] if args.force else [])
    if ignored:
        raise ConfigError(f"pipezero verify runs --steps steps of the layout and of one process, fresh, in --out, "
                          f"without checkpoints; it takes no {ignored[0]}: drop it")
    cfg = build_config(args.config, settings, names)
    launch = build_launch(launch_values, names)
    if launch.nproc is not None and launch.nproc != cfg.parallel.world_size:  # else one process would train, unsaid
        raise ConfigError(f"--nproc {launch.nproc} but pp x dp = {cfg.parallel.world_size}; make them equal (verify "
                          f"starts the layout's pp x dp ranks)")
    out = Path(cfg.run.out)
    if not cfg.run.out.strip() or (out.exists() and not out.is_dir()):  # else every rank's mkdir fails
        raise ConfigError(f"--out {cfg.run.out!r} is {'empty' if not cfg.run.out.strip() else 'a file'}: name a folder "
                          f"for verify's runs")
    _, cuda = rank_limit_gib(cfg, launch.nproc or cfg.parallel.world_size)  # verify starts the layout's ranks
    if not under_torchrun():
        check_host_memory(cfg, cuda)  # --preset 7b: minutes of building before the kernel killed it
    return verify_layout(cfg, args.steps, launch.nproc, args.argv)

