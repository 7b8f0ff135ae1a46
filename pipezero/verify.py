"""`pipezero verify`: show that a layout trains the same model as one process, before trusting it.

The project's central promise is layout independence: for a fixed seed, data, global batch and
sequence length, every (P, D, ZeRO stage, schedule, V, M) trains the model `--pp 1 --dp 1` trains.
`verify` checks that promise for the layout a user is about to run: K steps of the layout (its
ranks launched like `train --nproc N`) and K steps of one process with the same model, seed,
global batch, sequence length and dtype, then it compares

- per step, the loss and the global gradient norm every rank reports;
- after the last step, every parameter every rank holds, against the one-process parameter of the
  same name: each data-parallel replica on its own (a replica that drifted is named), ZeRO shards
  reassembled (ZeRO-3 gathers them, as for a snapshot), tied embeddings at both ends.

Errors are relative, over whole tensors: Adam turns rounding noise in a near-zero gradient element
into a ~1e-6 step of that element alone, so element-wise ratios near zero are noise while the
tensor's error says whether the same model was trained. Because that noise grows with the
learning rate, one process is also trained with its batch cut another way (`rounding_floor`), and
a failure of the size of that run's own error is named rounding rather than another model. Before
anything runs, the static proof that the schedule's transfer order cannot deadlock
(schedules/posting.py) is printed.

The launching process runs the one-process reference and the comparison; each rank writes its
losses, norms and parameters to `OUT/ranks/rankR.pt`, so verify runs on one machine (`--nproc`).
"""

from __future__ import annotations

import copy
import io
import json
import re
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pipezero.config import DType, Offload, ScheduleKind, SecondaryShard, ShareDevice, TrainConfig, Zero3Unit
from pipezero.errors import ConfigError
from pipezero.settings import validate
from pipezero.files import atomic_write_bytes, atomic_write_json

if TYPE_CHECKING:
    from rich.console import Console

    from pipezero.summary import RunResult

@dataclass(frozen=True)
class Tolerance:
    """Largest relative error accepted. fp32: summation order alone (another cut of the batch into
    micro-batches, another reduction tree) leaves ~1e-6 after a few steps of the tiny model at lr
    1e-3, so 1e-5 separates rounding from a bug there; the floor grows with the rate (8.4e-6 at
    1e-2), which `rounding_floor` measures for the run at hand. bf16 computes in 8-bit mantissas
    (unit 3.9e-3) in another order than one bf16 process does: measured over 3 steps of `tiny`
    (P=2, and D=2 ZeRO-2), losses within 1.3e-5, gradient norms 2.8e-4, parameters 9.7e-4; a bug
    moves them by far more."""

    loss: float
    grad_norm: float
    params: float


# The gradient norm is the most sensitive figure: it is taken from gradients of parameters that
# already differ by rounding, before clipping. As under bf16 (loss 2e-3, norm 1e-2), fp32 allows it
# five times the loss's error: measured 1.0e-5 to 1.3e-5 at step 3 for pp=2 dp=4 ZeRO-3 layer by
# layer (16 micro-batch gradients summed as 4 x 4), whose loss and parameters stay within 1e-5.
TOLERANCES = {DType.FP32: Tolerance(1e-5, 5e-5, 1e-5), DType.BF16: Tolerance(2e-3, 1e-2, 2e-2)}

# A failure within this factor of the rounding floor (`recut`) is called rounding, not a wrong
# model. Measured, D=2 layout against its re-cut one process, check by check: the tiny preset at lr
# 1e-2, parameters 9.35e-8 and 9.32e-8; the tests' tied model at lr 0.1, where 32 checks failed (up
# to 2.7e-4), at most 0.09 of the re-cut run's error (a micro-batch of another shape rounds more
# than another reduction order). A planted bug, one layer's gradient keeping one replica's half,
# ended 0.23 away at lr 1e-3, 1.6e5 times that rate's floor.
ROUNDING_FACTOR = 10.0


def relative_error(value: torch.Tensor, ref: torch.Tensor) -> float:
    """|value - ref| / |ref| over the whole tensor (the absolute error when ref is all zeros)."""
    diff = float((value.double() - ref.double()).norm())
    scale = float(ref.double().norm())
    return diff / scale if scale else diff


@dataclass(frozen=True)
class Check:
    """One comparison: a step's loss or norm on one rank, or one parameter of one rank."""

    what: str  # "loss", "grad_norm" or "param"
    step: int | None
    rank: int
    name: str  # parameter name ("" for loss and norm)
    value: float  # the layout's value (for a parameter: its norm)
    reference: float
    error: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance  # NaN fails


@dataclass
class RankResult:
    """What one rank of the layout reports back."""

    rank: int
    pp_rank: int
    dp_rank: int
    losses: list[float]
    grad_norms: list[float]
    params: dict[str, torch.Tensor]


def with_tied_head(params: dict[str, torch.Tensor], layout: TrainConfig) -> dict[str, torch.Tensor]:
    """One process ties the head to the embedding (one tensor, one name); a layout with more than
    one chunk keeps two copies, the head under its own name: give the reference's tensor that name
    too, so both ends are compared."""
    from pipezero.models import spec_of

    p = layout.parallel
    tied = spec_of(layout.model).tied_names()  # the built-in model's or a --model-spec's
    if tied is None or p.pp * p.virtual_stages == 1:
        return params
    return {**params, tied[1]: params[tied[0]]}


def compare_params(ranks: list[RankResult], ref: dict[str, torch.Tensor], tol: float) -> tuple[list[Check], list[str]]:
    """Every parameter of every rank against the reference, and what no rank holds or the
    reference lacks (a layout that dropped or invented a parameter)."""
    checks, held = [], set()
    for r in ranks:
        for name, value in sorted(r.params.items()):
            held.add(name)
            if name not in ref:
                continue
            checks.append(Check("param", None, r.rank, name, float(value.double().norm()),
                                float(ref[name].double().norm()), relative_error(value, ref[name]), tol))
    problems = [f"no rank holds {n}" for n in sorted(set(ref) - held)]
    problems += [f"rank(s) {[r.rank for r in ranks if n in r.params]} hold {n}, unknown to one process"
                 for n in sorted(held - set(ref))]
    return checks, problems


def compare_steps(ranks: list[RankResult], losses: list[float], norms: list[float], tol: Tolerance) -> list[Check]:
    """Each step's loss and gradient norm on every rank (all ranks must report the global values)."""
    checks = []
    for r in ranks:
        for what, mine, ref, t in (("loss", r.losses, losses, tol.loss),
                                   ("grad_norm", r.grad_norms, norms, tol.grad_norm)):
            if len(mine) != len(ref):
                checks.append(Check(what, None, r.rank, f"{len(mine)} steps, want {len(ref)}", 0, 0, float("inf"), t))
                continue
            for step, (a, b) in enumerate(zip(mine, ref), start=1):
                err = abs(a - b) / abs(b) if b else abs(a - b)
                checks.append(Check(what, step, r.rank, "", a, b, err, t))
    return checks


# --- running ---------------------------------------------------------------------------------------

def layout_config(cfg: TrainConfig, steps: int) -> TrainConfig:
    """The user's layout for `steps` steps under OUT/layout: no checkpoints, resume or text sample."""
    run = copy.deepcopy(cfg)
    r = run.run
    r.max_steps, r.sample_tokens, r.checkpoint_every, r.resume, r.eval_every, r.quiet = steps, 0, 0, False, 0, True
    r.save_final = False
    r.out = str(Path(cfg.run.out) / "layout")
    return validate(run)


def reference_config(layout: TrainConfig, out: Path) -> TrainConfig:
    """One process, the same model, seed, data, global batch, sequence length, dtype and steps."""
    ref = copy.deepcopy(layout)
    p = ref.parallel
    p.microbatches, p.pp, p.dp, p.zero = p.microbatches * p.dp, 1, 1, 0
    p.schedule, p.virtual_stages, p.stage_layers, p.zero3_keep_gathered = ScheduleKind.ONE_F_ONE_B, 1, None, None
    # what only data-parallel traffic has: one process has none to split by node or reduce in two
    # levels (both exact); kept, --secondary-shard would be refused for --dp 1 after the layout had run
    p.secondary_shard, p.hierarchical = SecondaryShard.NONE, False
    p.zero3_unit = Zero3Unit.LAYER  # how ZeRO-3 cuts its gathers: one process gathers nothing
    # where bytes wait between uses: the reference keeps everything on its device
    p.offload, p.offload_activations = Offload.NONE, 0
    ref.run.share_device = ShareDevice.OFF  # one process has no peer to stage a transfer for
    ref.run.out = str(out / "reference")
    return validate(ref)


def recut(ref: TrainConfig) -> TrainConfig | None:
    """The one-process reference with its global batch cut into other micro-batches: twice as
    large, else half as large, else one. The sequences of a step stay the same (they depend only
    on the global batch), so only the summation order changes: how far this run ends from the
    reference is the rounding floor at this learning rate. None: a batch of one sequence."""
    p = ref.parallel
    m, b = p.microbatches, p.micro_batch_size
    cut = (m // 2, 2 * b) if m % 2 == 0 else (2 * m, b // 2) if b % 2 == 0 else (1, m * b) if m > 1 else None
    if cut is None:
        return None
    floor = copy.deepcopy(ref)
    floor.parallel.microbatches, floor.parallel.micro_batch_size = cut
    floor.run.out = str(Path(ref.run.out).parent / "floor")
    return validate(floor)


def within_rounding(failed: list[Check], floor: list[Check], factor: float = ROUNDING_FACTOR) -> bool:
    """Whether every failed check is within `factor` of the same check (what, step, parameter) of
    the re-cut one-process run: the layout then differs from one process about as one process
    differs from itself, and the tolerance is below this learning rate's rounding."""
    same = {(c.what, c.step, c.name): c.error for c in floor}
    return bool(failed) and all(c.error <= factor * same.get((c.what, c.step, c.name), 0.0) for c in failed)


def run_rank(cfg: TrainConfig, out: Path) -> RankResult:
    """Train the layout on this rank (one of the job) and write what it holds to `out`."""
    from pipezero.engine import train
    from pipezero.parallel.mesh import Mesh

    res = train(cfg, snapshot=True)
    rank = int(os.environ.get("RANK", "0"))
    mesh = Mesh(cfg.parallel.pp, cfg.parallel.dp, rank, cfg.parallel.placement)
    result = RankResult(rank, mesh.pp_rank, mesh.dp_rank, res.losses, res.grad_norms, res.params)
    out.mkdir(parents=True, exist_ok=True)
    data = io.BytesIO()  # torch.save's own writer says 'unexpected pos 704 vs 598' for a full disk: written here
    torch.save(vars(result), data)  # asdict would deep-copy every tensor
    atomic_write_bytes(out / f"rank{rank}.pt", data.getvalue())
    return result


def transfer_proof(cfg: TrainConfig) -> dict:
    """The layout's plan, compiled as its ranks will compile it (schedules/compile.py), with
    schedules/posting.py's static proof in it: every rank posts its transfers in one global order
    with no cycle among stream order, compute order and waits."""
    from pipezero.models import spec_of
    from pipezero.schedules.check import ScheduleError
    from pipezero.stage import plan_of

    try:
        plan, _ = plan_of(cfg, spec_of(cfg.model))
    except ScheduleError as e:
        return {"proven": False, "error": str(e)}
    return {"proven": True, "transfers": sum(q.send for rank in plan.proven.posts for posts in rank for q in posts)}


def describe(cfg: TrainConfig) -> str:
    p = cfg.parallel
    return (f"pp={p.pp} dp={p.dp} zero={p.zero} schedule={p.schedule.value} M={p.microbatches} "
            f"V={p.virtual_stages} dtype={cfg.run.dtype.value}")


# what verify writes into --out: its runs' folders, the layout's ranks' results, the report, and the
# hang doctor's requests (runtime/watch.py)
RANK_FILE = re.compile(r"rank[0-9]+\.pt")  # what a rank of verify writes in OUT/ranks
OWN = {"layout": True, "reference": True, "floor": True, "ranks": True, "doctor": True, "verify.json": False,
       ".lock": False}


def check_out(out: Path) -> None:
    """Refuse an --out holding anything verify did not write (a run's folder, the user's files):
    verify made its folders beside them, and its runs replace what is at those names. A folder of
    an earlier verify is verify's own, written again."""
    if not out.is_dir():
        return
    foreign = sorted(p.name for p in out.iterdir() if p.name not in OWN)
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise ConfigError(f"--out {out} holds {foreign[0]!r}{more}, which verify did not write; verify writes "
                          f"layout/, reference/, floor/, ranks/ and verify.json into a folder of its own: give a new "
                          f"or empty folder")
    report = out / "verify.json"
    if report.is_file() and not report.is_symlink() and not verify_report(report):  # a link, a folder: below
        raise ConfigError(f"--out {out}: verify.json is not a report verify wrote, and verify would replace it: give a "
                          f"new or empty folder")
    runs = [name for name in ("layout", "reference", "floor") if (out / name).is_dir() and any((out / name).iterdir())]
    if runs and not verify_report(report):  # an earlier verify writes its report last, beside its runs
        raise ConfigError(f"--out {out}: {runs[0]}/ holds files but no verify report (verify.json) is beside it, so it "
                          f"is no earlier verify's (a training run of yours, or a verify stopped before its end); "
                          f"verify would write its runs over it: give a new or empty folder")
    ranks = out / "ranks"
    strays = sorted(p.name for p in ranks.iterdir() if not RANK_FILE.fullmatch(p.name)) if ranks.is_dir() else []
    if strays and not ranks.is_symlink():  # its stale rank files are deleted before the layout runs
        raise ConfigError(f"--out {out}: ranks/ holds {strays[0]!r}, which verify did not write (it writes rankR.pt "
                          f"there and deletes the earlier ones): give a new or empty folder")
    for name, folder in OWN.items():
        entry = out / name
        if entry.is_symlink() or (entry.exists() and entry.is_dir() != folder):
            kind = "a symlink" if entry.is_symlink() else "a folder" if entry.is_dir() else "a file"
            raise ConfigError(f"--out {out}: {name} is {kind}, where verify writes a {'folder' if folder else 'file'}: "
                              f"give a new or empty folder")


def verify_report(path: Path) -> bool:
    """Whether `path` is a report verify wrote (verify.json: its layout, steps and verdict)."""
    if path.is_symlink() or not path.is_file():
        return False
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(report, dict) and {"layout", "steps", "ok"} <= report.keys()


def lossy_traffic(cfg: TrainConfig) -> str | None:
    """Why the layout cannot match one process by design, or None. Quantized traffic changes each
    step's numbers (~1e-3 relative) where one process has no traffic to quantize: asked before the
    layout runs, since the reference (--dp 1) cannot take the layout's --quantize-* flags."""
    p = cfg.parallel
    for flag, value in (("--quantize-weights", p.quantize_weights.value), ("--quantize-grads", p.quantize_grads.value)):
        if value != "none":
            return (f"{flag} {value} changes every step's numbers by design (blockwise {value}, about 1e-3 relative), "
                    f"and one process has no data-parallel traffic to quantize, so verify's comparison would fail "
                    f"whatever the layout: verify it without {flag}; quantization's cost is measured in held-out loss "
                    f"(docs/how-to/quantize.md)")
    return None


def verify_layout(cfg: TrainConfig, steps: int, nproc: int | None, argv: list[str]) -> int:
    """The `pipezero verify` command: 0 when the layout matches one process within tolerance, else 1.
    Under torchrun (the ranks it launched) it trains this rank and leaves."""
    from pipezero.launch import exit_rank, under_torchrun
    from pipezero.slurm import in_srun_step, step_tasks

    if (lossy := lossy_traffic(cfg)) is not None:
        raise ConfigError(lossy)
    out = Path(cfg.run.out)
    run_cfg = layout_config(cfg, steps)
    if under_torchrun():
        run_rank(run_cfg, out / "ranks")
        exit_rank(0)
    world = cfg.parallel.world_size
    if in_srun_step(os.environ) and step_tasks(os.environ) > 1:  # each task would start the whole layout
        raise ConfigError(f"pipezero verify starts the layout's ranks itself, but this srun step has "
                          f"{step_tasks(os.environ)} tasks (SLURM_NTASKS), each of which would: run it in a step of "
                          f"one task, `srun --ntasks 1 pipezero verify --nproc {world} ...`")
    if world > 1 and nproc != world:
        raise ConfigError(f"pipezero verify starts the layout's ranks itself: pass --nproc {world}")
    check_out(out)
    from pipezero.rundir import held

    with held(out) as lock_fd:  # another verify at this --out is refused: each would read the other's rank files
        return _verify(cfg, steps, argv, out, run_cfg, lock_fd)


def _verify(cfg: TrainConfig, steps: int, argv: list[str], out: Path, run_cfg: TrainConfig, lock_fd: int) -> int:
    """verify_layout's work, under its hold on `out`."""
    from rich.console import Console

    from pipezero.engine import train
    from pipezero.launch import launch_local, preflight, with_device

    world = cfg.parallel.world_size
    console = Console(soft_wrap=True)  # lines a user may grep stay whole; the table still fits
    proof = transfer_proof(cfg)
    p = cfg.parallel
    console.print(f"transfer order ({p.schedule.value}, P={p.pp}, M={p.microbatches}): "
                  + (f"{proof['transfers']} transfers posted in one global order, proven free of deadlock on "
                     f"ordered streams (schedules/posting.py verify)" if proof["proven"] else
                     f"REJECTED\n{proof['error']}"))
    tol = TOLERANCES[cfg.run.dtype]
    report = {"layout": describe(cfg), "steps": steps, "tolerance": asdict(tol), "transfer_order": proof}
    if not proof["proven"]:
        atomic_write_json(out / "verify.json", {**report, "ok": False})
        return 1
    console.print(f"training {steps} steps of {describe(cfg)} ...")
    if world > 1:
        device = preflight(cfg, world)  # data, tokenizer and the ranks' device, checked once here
        for old in (out / "ranks").glob("rank*.pt"):
            if RANK_FILE.fullmatch(old.name):  # an earlier verify's; check_out refused anything else there
                old.unlink()
        # verify writes no checkpoint and takes no --resume: its stop line must not offer either
        code = launch_local(world, with_device(argv, device.value), str(out),
                            after_stop="verify stopped before it compared anything: run the same command again",
                            lock_fd=lock_fd)
        if code:
            atomic_write_json(out / "verify.json", {**report, "ok": False, "problems": [f"ranks exited {code}"]})
            if code > 128:  # stopped by a signal: the launcher said so; exit as an interrupted command
                return code
            console.print(f"[red]the layout's ranks failed (exit {code})[/red]")
            return 1
        ranks = [RankResult(**torch.load(out / "ranks" / f"rank{r}.pt", weights_only=True)) for r in range(world)]
    else:
        ranks = [run_rank(run_cfg, out / "ranks")]
    console.print(f"training {steps} steps of one process (pp=1 dp=1, M={p.microbatches * p.dp}) ...")
    ref_cfg = reference_config(run_cfg, out)
    ref = train(ref_cfg, snapshot=True)
    checks, problems = against(ranks, ref, cfg)
    floor_cfg, floor = rounding_floor(ref_cfg, ref, cfg, console)
    ok = not problems and all(c.ok for c in checks)
    console.print(table(checks, ranks, describe(cfg), steps, floor, tol))
    failed = [c for c in checks if not c.ok]
    for line in problems + [failure(c, ranks) for c in failed]:
        console.print(f"[red]FAILED[/red] {line}")
    rounding = not problems and within_rounding(failed, floor)
    cut = None if floor_cfg is None else [floor_cfg.parallel.microbatches, floor_cfg.parallel.micro_batch_size]
    console.print(verdict(ok, rounding, tol, cut, cfg.optim.lr, bool(problems)))
    atomic_write_json(out / "verify.json", {**report, "ok": ok, "problems": problems,
                                            "failed": [failure(c, ranks) for c in failed],
                                            "checks": [{**asdict(c), "ok": c.ok} for c in checks],
                                            "rounding_floor": {"cut": cut, "checks": [asdict(c) for c in floor]},
                                            "within_rounding": rounding})
    return 0 if ok else 1


def rounding_floor(ref_cfg: TrainConfig, ref: RunResult, layout: TrainConfig,
                   console: Console) -> tuple[TrainConfig | None, list[Check]]:
    """One process again with its batch re-cut (`recut`), compared with the reference as the
    layout's ranks are: what rounding alone moves at this learning rate, check by check."""
    from pipezero.engine import train

    floor_cfg = recut(ref_cfg)
    if floor_cfg is None:
        return None, []
    p = floor_cfg.parallel
    console.print(f"training them again with the batch cut as M={p.microbatches} x {p.micro_batch_size} "
                  f"sequences (the rounding floor) ...")
    again = train(floor_cfg, snapshot=True)
    me = [RankResult(0, 0, 0, again.losses, again.grad_norms, with_tied_head(again.params, layout))]
    return floor_cfg, against(me, ref, layout)[0]


def against(ranks: list[RankResult], ref: RunResult, layout: TrainConfig) -> tuple[list[Check], list[str]]:
    """Every step's loss and norm, then every parameter, of `ranks` against one process's `ref`
    (both ends of a tied embedding compared), at the layout's dtype's tolerance; and what no rank
    holds or the reference lacks."""
    tol = TOLERANCES[layout.run.dtype]
    params, problems = compare_params(ranks, with_tied_head(ref.params, layout), tol.params)
    return compare_steps(ranks, ref.losses, ref.grad_norms, tol) + params, problems


def verdict(ok: bool, rounding: bool, tol: Tolerance, cut: list[int] | None, lr: float, problems: bool) -> str:
    """The closing line: OK, a failure within rounding (`within_rounding`), or another model (a
    parameter missing or invented: `problems`)."""
    if ok:
        return f"[green]OK[/green]: every rank matches one process within {asdict(tol)} (relative)"
    if rounding and cut:
        return (f"[yellow]every failure is within {ROUNDING_FACTOR:g}x of what one process differs from itself by "
                f"(its batch as M={cut[0]} x {cut[1]}, column 'rounding'): at lr {lr:g} Adam lifts rounding above "
                f"the tolerance, so this does not show another model; verify again with a lower --lr (1e-3 or "
                f"below) to tell[/yellow]")
    beyond = f": its errors exceed {ROUNDING_FACTOR:g}x what one process differs from itself by (column " \
             f"'rounding')" if cut and not problems else ""
    return f"[red]the layout trains another model[/red]{beyond}"


def _where(rank: int, ranks: list[RankResult]) -> str:
    r = next(x for x in ranks if x.rank == rank)
    return f"rank {rank} (stage {r.pp_rank}, replica {r.dp_rank})"


def failure(c: Check, ranks: list[RankResult]) -> str:
    what = c.name if c.what == "param" else f"{c.what} at step {c.step}"
    return f"{_where(c.rank, ranks)} {what}: relative error {c.error:.2e} > {c.tolerance:.0e}"


def table(checks: list[Check], ranks: list[RankResult], layout: str, steps: int, floor: list[Check],
          tol: Tolerance):
    """Steps (worst rank each) and parameters (worst tensor of each rank), failures spelled out;
    beside each error, the same check's error of one process re-cut (`rounding_floor`). Narrow
    enough for 80 columns: the tolerances go in the caption."""
    from rich.table import Table

    same = {(c.what, c.step, c.name): c.error for c in floor}
    t = Table(title=f"pipezero verify: {layout} against one process, {steps} steps",
              caption=f"relative errors; tolerance: loss {tol.loss:.0e}, grad norm {tol.grad_norm:.0e}, parameters "
                      f"{tol.params:.0e}; rounding: one process against itself, its batch cut another way")
    for col, just in (("check (worst rank)", "left"), ("rank", "left"), ("1 process", "right"), ("rel err", "right"),
                      ("rounding", "right"), ("", "center")):
        t.add_column(col, justify=just, no_wrap=col.startswith("check"))  # type: ignore[arg-type]

    def row(label: str, where: str, c: Check) -> None:
        rounding = same.get((c.what, c.step, c.name))
        t.add_row(label, where, f"{c.reference:.6g}", f"{c.error:.1e}", "-" if rounding is None else f"{rounding:.1e}",
                  "[green]ok[/green]" if c.ok else "[red]FAIL[/red]")

    for step in range(1, steps + 1):
        for what in ("loss", "grad_norm"):
            mine = [c for c in checks if c.what == what and c.step == step]
            if mine:
                worst = max(mine, key=lambda c: c.error)
                row(f"{what.replace('_', ' ')}, step {step}", str(worst.rank), worst)
    for r in ranks:
        mine = [c for c in checks if c.what == "param" and c.rank == r.rank]
        where = f"{r.rank} (pp{r.pp_rank} dp{r.dp_rank})"
        if mine:
            worst = max(mine, key=lambda c: c.error)
            row(f"{len(mine)} parameters", where, worst)
            for c in mine:
                if not c.ok:
                    row(c.name, where, c)
    return t
