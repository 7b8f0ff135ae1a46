"""`pipezero probe`: this machine's costs at a run's shapes (pipezero/probe.py), printed and written
for `plan` to plan with."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from pipezero.errors import ConfigError
from pipezero.cli.flags import add_train_flags, flag_values

BUDGET = (0.01, 10.0)  # seconds a figure may take: past 10 the probe is no longer "seconds"
# the settings a probe reads: the model, its shapes and dtype, where it computes; no layout
READS = ("model.preset", "model.pretrained", "parallel.micro_batch_size", "data.seq_len", "run.seed", "run.dtype",
         "run.device", "run.threads")


def describe(p: argparse.ArgumentParser) -> None:
    """`probe`'s own flags (add_probe_parser registers the command with the run settings it READS)."""
    from pipezero.probe import MOST_S  # torch: imported as the parser is built, as the train flags' are
    p.add_argument("--json", dest="json_out", metavar="FILE", help="write the figures here (a new file; -: standard output)")
    p.add_argument("--budget", type=float, default=0.5, metavar="SECONDS",
                   help=f"seconds each figure's repetitions may take (default 0.5; {BUDGET[0]:g} to {BUDGET[1]:g}); "
                        f"a block whose first forward says the probe would take past {MOST_S:g} s is refused")


def cmd_probe(args: argparse.Namespace, values: dict[str, Any], names: dict[str, str]) -> int:
    """`values`: the run settings given as flags (cli/flags.py `flag_values`), `names` their flags."""
    import torch

    from pipezero.parallel.device import device_kind, rank_device
    from pipezero.probe import ProbeError, probe
    from pipezero.settings import BatchTooLarge, build_config
    from pipezero.files import atomic_write_json

    if not BUDGET[0] <= args.budget <= BUDGET[1]:
        raise ConfigError(f"--budget {args.budget:g}: expected seconds from {BUDGET[0]:g} to {BUDGET[1]:g}")
    to_stdout = args.json_out == "-"  # the JSON alone on standard output, the figures' lines on stderr
    if to_stdout:
        args.json_out = None
    if args.json_out is not None and (not args.json_out.strip() or os.path.lexists(args.json_out)):
        raise ConfigError(f"--json {args.json_out!r}: name a new file (the probe never writes over one)")
    if args.json_out is not None and (folder := existing_parent(Path(args.json_out))) is not None \
            and not folder.is_dir():  # said now, not after the seconds of timing
        raise ConfigError(f"--json {args.json_out!r}: {folder} is not a folder; name a file in one")
    if args.json_out is not None and (folder := existing_parent(Path(args.json_out))) is not None:
        check_writable(args.json_out, folder)
    try:
        cfg = build_config(args.config, values, names)
    except BatchTooLarge as e:
        from pipezero.schedules.limits import BATCH_TOKENS

        if e.micro_batch_tokens <= BATCH_TOKENS:  # the layout's M micro-batches, which the probe does not read
            cfg = build_config(args.config, {**values, "parallel.microbatches": 1}, names)
        else:
            raise ConfigError(f"--micro-batch-size x --seq-len = {e.micro_batch_tokens} tokens in the one micro-batch "
                              f"the probe times, past the {BATCH_TOKENS} a rank holds: probe at a smaller "
                              f"--micro-batch-size or --seq-len") from None
    torch.set_num_threads(cfg.run.threads or torch.get_num_threads())
    device = rank_device(device_kind(cfg.run.device))
    check_block_fits(cfg, device)
    try:
        found = probe(cfg, device, budget_s=args.budget, host=True)
    except ProbeError as e:
        print(f"pipezero: error: {e}", file=sys.stderr)
        return 1
    b = found.block_s
    said = sys.stderr if to_stdout else sys.stdout
    print(f"{found.device}, {found.dtype}, micro-batch {found.micro_batch} x {found.seq_len} tokens, "
          f"{cfg.model.preset or 'model'} block", file=said)
    print(f"  block F {b['F'] * 1e3:.2f} ms, B {b['B'] * 1e3:.2f} ms, W {b['W'] * 1e3:.2f} ms: "
          f"{found.tflops:.4g} TFLOP/s achieved; an action's fixed cost {found.overhead_s * 1e3:.2f} ms", file=said)
    print(f"  host copy {found.host_copy_gbps:.3g} GB/s each way; AdamW on the host "
          f"{found.host_adamw_params_s / 1e6:.0f}M parameters/s; probe took {found.seconds:.1f} s", file=said)
    if to_stdout:
        print(json.dumps(found.to_json(), indent=2, sort_keys=True))
    elif args.json_out is not None:
        atomic_write_json(Path(args.json_out), found.to_json())
        print(f"wrote {args.json_out}")
    return 0


def existing_parent(path: Path) -> Path | None:
    """The nearest of `path`'s parents that exists (the probe makes the folders below it)."""
    return next((p for p in path.absolute().parents if os.path.lexists(p)), None)


def check_writable(name: str, folder: Path) -> None:
    """A file can be made in `folder` (the nearest that exists of --json's): said now, before the
    seconds of timing, not as the write's traceback after them. A file is made and removed at once."""
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ConfigError(f"--json {name!r}: no file can be written in {folder} ({e.strerror}): name a file in a "
                          f"folder you can write") from None


def check_block_fits(cfg: Any, device: Any) -> None:
    """The probe holds one block's activations at the run's micro-batch (and their gradients): where
    the memory model's bytes for them pass the device's memory, refused before any allocation (the
    kernel killed a probe of --micro-batch-size 100000)."""
    import torch

    from pipezero.models.presets import block_params
    from pipezero.memory.model import Shapes, layer_bytes

    m = cfg.model
    s = Shapes.of(m, cfg.parallel.micro_batch_size, cfg.data.seq_len, cfg.run.dtype)
    one = layer_bytes(s, 1, m.n_layers, block_params(m))
    need = one.held + one.stash + one.backward_extra + 2 * s.tokens * s.dim * s.act + 4 * 4 * block_params(m)
    cuda = device.type == "cuda"
    have = torch.cuda.mem_get_info(device)[0] if cuda else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    where = f"this {'GPU' if cuda else 'machine'}'s {have / 2**30:.1f} GiB{' free' if cuda else ''}"
    if need > have:
        raise ConfigError(f"one block at --micro-batch-size {cfg.parallel.micro_batch_size} x --seq-len "
                          f"{cfg.data.seq_len} needs about {need / 2**30:.1f} GiB, more than {where}: probe at a "
                          f"smaller --micro-batch-size")


def add_probe_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("probe", allow_abbrev=False, help="measure this machine's compute and host costs",
                       description="Time one decoder block's forward, input and weight gradient at the run's "
                                   "micro-batch (the FLOP rate a rank achieves and what an action costs beyond "
                                   "its FLOPs), a copy to host memory and back, and AdamW on the host; print them "
                                   "and write them as JSON for `pipezero plan --costs`.")
    add_train_flags(p, READS)
    describe(p)
    p.set_defaults(func=lambda args: cmd_probe(args, *flag_values(args)[::2]))

