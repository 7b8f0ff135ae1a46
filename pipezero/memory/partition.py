"""The `memory` partition policy: stage cuts that minimise the largest predicted per-rank peak.

Balancing parameters or compute leaves memory lopsided under a pipeline schedule: 1F1B's first rank
holds P micro-batches of activations and the last holds one, the embedding sits on the first rank
and the head (with its vocabulary-wide logits) on the last. The memory model (memory/model.py) knows
all of that from the lowered program, so this policy asks it, rather than a formula, what a rank
peaks at for a given cut, and searches the cuts:

- one chunk a rank (every schedule at V = 1): each rank's peak depends only on its own layers and
  grows as it takes more, so a greedy fill (each rank in turn takes the most layers that stay under
  a limit) decides whether a limit is reachable, and a bisection on the limit finds the least one;
- several chunks a rank (interleaved, looped-BFS, V-shaped placements), and to polish the above:
  descent from the best of the other policies' cuts, moving one layer at a time out of a chunk of
  the rank that peaks highest into any other chunk, while the peaks sorted high to low drop
  (compared in order, so a tie at the top still moves).

Every chunk keeps at least one layer. A rank's peak is cached by its own chunks' bounds (walks of
other ranks do not change it), so the search walks each distinct (rank, layers) once. Torch-free:
the runtime (stage.py), the fit check (memory/fit.py), summary.json's prediction and `simulate
--memory` all cut through `resolve`, so a run is cut as its prediction says. (memory/model.py itself
refuses an unresolved `memory` policy, through parallel/partition.cut_bounds: it cannot import this
module, which walks it.)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING

from pipezero.config import (DataConfig, DType, ModelConfig, Offload, Packing, ParallelConfig, Partition, RunConfig,
                             TrainConfig)
from pipezero.errors import ConfigError
from pipezero.models.presets import layer_costs, layer_param_counts
from pipezero.parallel.partition import cut_bounds
from pipezero.schedules.compile import proven_of
from pipezero.memory.model import RankMemory, build_plan, walk

if TYPE_CHECKING:
    from pipezero.planner.layouts import Layout


@dataclass(frozen=True)
class Balanced:
    """The memory policy's choice for one run configuration."""

    counts: tuple[int, ...]  # layers a stage chunk, in model order (embedding and head included)
    peaks: tuple[int, ...]  # each pipeline rank's predicted peak bytes with these cuts
    start: str  # the policy whose cuts the search began from (uniform, params or cost)
    walks: int  # distinct (rank, layers) the memory model walked


def resolve(cfg: TrainConfig, cuda: bool | None = None) -> TrainConfig:
    """`cfg` with the memory policy's cuts written into `parallel.stage_layers`; `cfg` itself under
    any other policy or with explicit cuts. `cuda` as in memory/model.build_plan (the runtime and the
    prediction pass the same, so they cut alike)."""
    p = cfg.parallel
    if p.partition is not Partition.MEMORY or p.stage_layers is not None:
        return cfg
    counts = balance(cfg, cuda).counts
    return replace(cfg, parallel=replace(p, stage_layers=list(counts)))


def balance(cfg: TrainConfig, cuda: bool | None = None) -> Balanced:
    """The cuts of `cfg`'s layout that minimise the largest predicted per-rank peak."""
    if cfg.model.spec is not None:
        raise ConfigError(f"--partition memory with --model-spec {cfg.model.spec}: the memory model knows the built-in "
                          f"decoder's layers, not a spec of one's own; use --partition params or cost, or "
                          f"--stage-layers")
    return _balance(_Key(cfg), cuda)


class _Key:
    """A TrainConfig (mutable) as a cache key, by the value of what the memory model reads, taken
    when the key is made: a copy, so changing the caller's configuration later changes no key."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = copy.deepcopy(cfg)
        self.ident = repr((cfg.model, cfg.parallel, cfg.data, cfg.run.dtype, cfg.run.device))

    def __hash__(self) -> int:
        return hash(self.ident)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Key) and other.ident == self.ident


@lru_cache(maxsize=64)
def _balance(key: _Key, cuda: bool | None) -> Balanced:
    return search(key.cfg, cuda)


def search(cfg: TrainConfig, cuda: bool | None = None) -> Balanced:
    """`balance` uncached (the bench times it). A run asks `balance`, whose cache answers its start,
    its fit check and its summary with one search."""
    p = cfg.parallel
    schedule = proven_of(p.schedule, p.pp, p.microbatches, p.virtual_stages).schedule
    n_chunks = schedule.n_chunks
    params = layer_param_counts(cfg.model)
    n_layers = len(params)
    if n_chunks > n_layers:
        raise ConfigError(f"pp x virtual-stages = {n_chunks} stage chunks but the model has only {n_layers} layers; "
                          f"lower --pp/--virtual-stages")
    peaks = _Peaks(cfg, cuda, [schedule.chunks(r) for r in range(p.pp)])
    starts = {}
    for policy in (Partition.UNIFORM, Partition.PARAMS, Partition.COST):
        bounds = cut_bounds(params, lambda: layer_costs(cfg.model, cfg.data.seq_len), n_chunks, policy)
        starts.setdefault(tuple(b - a for a, b in bounds), policy.value)
    start_counts = min(starts, key=lambda c: _order(peaks.all(c)))
    best = start_counts
    if all(schedule.chunks(r) == (r,) for r in range(p.pp)):
        filled = _bisect(peaks, n_layers, p.pp, max(peaks.all(best)))
        if filled is not None and _order(peaks.all(filled)) < _order(peaks.all(best)):
            best = filled
    best = _descend(peaks, best, schedule.rank_of_chunk)
    return Balanced(best, tuple(peaks.all(best)), starts[start_counts], peaks.walks)


def _order(peaks: list[int]) -> tuple[int, ...]:
    """Peaks high to low: the smaller tuple is the better cut (the largest peak first, then the next)."""
    return tuple(sorted(peaks, reverse=True))


class _Peaks:
    """Each pipeline rank's predicted peak for a cut, walked once per (rank, what its chunks hold).
    A chunk is known by its layers' kinds (the embedding, a block, the head), parameter counts and
    sliding windows, not by where it starts: moving a layer between two chunks shifts the chunks
    between them, whose ranks then need no new walk."""

    def __init__(self, cfg: TrainConfig, cuda: bool | None, chunks_of: list[tuple[int, ...]]) -> None:
        self.cfg, self.cuda, self.chunks_of = cfg, cuda, chunks_of
        self.cache: dict[tuple, int] = {}
        self.walks = 0
        m = cfg.model
        params = layer_param_counts(m)
        last = len(params) - 1
        windows = set(m.window_layers) if m.window_layers is not None else None
        self.layers = [("embedding" if i == 0 else "head" if i == last else "block", n,
                        m.sliding_window is not None and (windows is None or i - 1 in windows))
                       for i, n in enumerate(params)]

    def rank(self, counts: tuple[int, ...], r: int) -> int:
        starts = [sum(counts[:c]) for c in range(len(counts) + 1)]
        key = (r, tuple(tuple(self.layers[starts[c]:starts[c + 1]]) for c in self.chunks_of[r]))
        if key not in self.cache:
            run = replace(self.cfg, parallel=replace(self.cfg.parallel, partition=Partition.UNIFORM,
                                                     stage_layers=list(counts)))
            self.cache[key] = walk(build_plan(run, self.cuda, (r,)), r).peak_bytes
            self.walks += 1
        return self.cache[key]

    def all(self, counts: tuple[int, ...]) -> list[int]:
        return [self.rank(counts, r) for r in range(len(self.chunks_of))]


def _fill(peaks: _Peaks, n_layers: int, pp: int, limit: int) -> tuple[int, ...] | None:
    """One chunk a rank, rank r holding chunk r: each rank in turn takes the most layers whose peak
    stays within `limit` (leaving one for each rank after it); None when some rank cannot. A rank's
    peak grows with the layers it takes, so it is found by bisection over its last layer."""
    counts: list[int] = []
    lo = 0
    for r in range(pp):
        rest = pp - 1 - r
        if rest == 0:
            trial = tuple(counts) + (n_layers - lo,)
            return trial if peaks.rank(trial, r) <= limit else None

        def fits(hi: int) -> bool:
            left = n_layers - hi  # the remaining ranks' layers, one each and the rest on the last
            trial = tuple(counts) + (hi - lo,) + (1,) * (rest - 1) + (left - (rest - 1),)
            return peaks.rank(trial, r) <= limit

        a, b = lo + 1, n_layers - rest  # the fewest and most layers rank r may end at
        if not fits(a):
            return None
        while a < b:  # the largest end that fits
            mid = (a + b + 1) // 2
            a, b = (mid, b) if fits(mid) else (a, mid - 1)
        counts.append(a - lo)
        lo = a
    return None


def _bisect(peaks: _Peaks, n_layers: int, pp: int, reachable: int) -> tuple[int, ...] | None:
    """The fill at the least limit a fill reaches, between 0 and `reachable` (a peak some cut has)."""
    low, best = -1, _fill(peaks, n_layers, pp, reachable)
    if best is None:  # a peak that does not grow with layers: the fill's premise fails; descend only
        return None
    high = max(peaks.all(best))
    while high - low > 1:
        mid = (low + high) // 2
        filled = _fill(peaks, n_layers, pp, mid)
        if filled is None:
            low = mid
        else:  # the fill's own largest peak is reachable, and at most `mid`
            best, high = filled, max(peaks.all(filled))
    return best


def _moves(counts: tuple[int, ...], peaks: list[int], rank_of_chunk: dict[int, int]) -> list[tuple[int, ...]]:
    """Every cut one layer away that takes it from a chunk of the highest-peaking rank (into any
    other chunk: a rank's own chunks hold different numbers of micro-batches)."""
    top = max(range(len(peaks)), key=lambda r: peaks[r])
    out = []
    for src in (c for c in range(len(counts)) if rank_of_chunk[c] == top and counts[c] > 1):
        for dst in range(len(counts)):
            if dst != src:
                moved = list(counts)
                moved[src] -= 1
                moved[dst] += 1
                out.append(tuple(moved))
    return out


def _descend(peaks: _Peaks, counts: tuple[int, ...], rank_of_chunk: dict[int, int]) -> tuple[int, ...]:
    """Take the move (`_moves`) that lowers the sorted peaks most, until none does; then look two
    moves ahead (the first may raise them: with several chunks a rank, the least peak can need two
    chunks to shrink at once), and go on while that finds a lower cut. Most cuts two moves away
    differ from the current one in a chunk or two, so their ranks' peaks are mostly cached."""
    current = _order(peaks.all(counts))
    while True:
        scored = sorted((_order(peaks.all(m)), m) for m in _moves(counts, peaks.all(counts), rank_of_chunk))
        better = scored[0] if scored else None
        if better is None or better[0] >= current:
            ahead = [(_order(peaks.all(m2)), m2) for _, m1 in scored
                     for m2 in _moves(m1, peaks.all(m1), rank_of_chunk)]
            better = min(ahead, default=None)
            if better is None or better[0] >= current:
                return counts
        current, counts = better


@dataclass(frozen=True)
class BalancedLayout:
    """What the planner (planner/search.py) needs of a candidate layout cut by memory."""

    peak: RankMemory  # the rank whose predicted peak is largest, with its categories
    counts: tuple[int, ...]  # layers a stage chunk
    blocks: int  # the most blocks one rank holds (its compute sets the pipeline's pace)
    params: int  # the most parameters one rank holds (its data-parallel traffic)
    walks: int  # the search's memory-model walks (the first time it ran)


def balanced_layout(model: ModelConfig, seq_len: int, lay: "Layout", bf16: bool, cuda: bool,
                    bucket_mb: float) -> BalancedLayout:
    """The planner's candidate `lay` cut by memory: its largest peak and its heaviest rank's share,
    from the run settings the candidate stands for (as memory/model.layout_memory builds them)."""
    par = ParallelConfig(pp=lay.pp, dp=lay.dp, zero=lay.zero, schedule=lay.schedule, microbatches=lay.microbatches,
                         micro_batch_size=lay.micro_batch, virtual_stages=lay.virtual, recompute=lay.recompute,
                         grad_reduce=lay.grad_reduce, bucket_mb=bucket_mb, partition=Partition.MEMORY,
                         offload=Offload.OPTIMIZER if lay.offload else Offload.NONE)
    cfg = TrainConfig(model=model, parallel=par, data=DataConfig(seq_len=seq_len, packing=Packing.CONCAT),
                      run=RunConfig(dtype=DType.BF16 if bf16 else DType.FP32))
    chosen = balance(cfg, cuda)
    top = max(range(lay.pp), key=lambda r: chosen.peaks[r])
    plan = build_plan(resolve(cfg, cuda), cuda, (top,))
    schedule = proven_of(lay.schedule, lay.pp, lay.microbatches, lay.virtual).schedule
    params = layer_param_counts(model)
    starts = [sum(chosen.counts[:c]) for c in range(len(chosen.counts) + 1)]
    held = [[i for c in schedule.chunks(r) for i in range(starts[c], starts[c + 1])] for r in range(lay.pp)]
    blocks = max(sum(1 for i in layers if 0 < i < len(params) - 1) for layers in held)
    return BalancedLayout(replace(walk(plan, top), rank=top * lay.dp), chosen.counts, blocks,
                          max(sum(params[i] for i in layers) for layers in held), chosen.walks)
