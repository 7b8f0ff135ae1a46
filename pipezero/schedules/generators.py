"""One generator a schedule: a short function of (P, M, V) that writes each rank's published order.

Every generator builds its ranks with `RankOrder`, which numbers micro-batches per (chunk, op) so
phases read as "forward chunk 0, backward chunk 1" rather than index arithmetic, and which keeps the
queue of deferred weight gradients that the zero-bubble schedules drain into their bubbles.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from pipezero.schedules.actions import Action, Op, ChunkPlacement, Schedule, chunks_of_rank


class RankOrder:
    """Appends one rank's actions; micro-batches of each (chunk, op) are taken in order 0, 1, 2, ..."""

    def __init__(self, microbatches: int) -> None:
        self.m = microbatches
        self.actions: list[Action] = []
        self._next: dict[tuple[int, Op], int] = {}
        self.pending_w: deque[tuple[int, int]] = deque()  # (chunk, mb) whose B ran and W did not

    def _take(self, chunk: int, op: Op) -> int | None:
        key = (chunk, Op.B if op is Op.BW else op)
        mb = self._next.get(key, 0)
        if mb >= self.m:
            return None  # the phase formula ran past M: nothing left of this kind
        self._next[key] = mb + 1
        return mb

    def f(self, chunk: int) -> None:
        mb = self._take(chunk, Op.F)
        if mb is not None:
            self.actions.append(Action(chunk, Op.F, mb))

    def bw(self, chunk: int) -> None:
        mb = self._take(chunk, Op.BW)
        if mb is not None:
            self.actions.append(Action(chunk, Op.BW, mb))

    def b(self, chunk: int) -> None:
        mb = self._take(chunk, Op.B)
        if mb is not None:
            self.actions.append(Action(chunk, Op.B, mb))
            self.pending_w.append((chunk, mb))

    def w(self) -> None:
        """Run the oldest deferred weight gradient, if any."""
        if self.pending_w:
            chunk, mb = self.pending_w.popleft()
            self.actions.append(Action(chunk, Op.W, mb))

    def drain_w(self) -> None:
        while self.pending_w:
            self.w()


def _build(name: str, pp: int, m: int, v: int, placement: ChunkPlacement,
           rank_fn: Callable[[RankOrder, int, tuple[int, ...]], None]) -> Schedule:
    ranks = []
    for r in range(pp):
        order = RankOrder(m)
        rank_fn(order, r, chunks_of_rank(placement, pp, v, r))
        order.drain_w()
        ranks.append(tuple(order.actions))
    return Schedule(name, pp, m, v, placement, tuple(ranks))


def gpipe(pp: int, m: int, v: int = 1) -> Schedule:
    """All forwards, then all backwards (Huang et al. 2019): M activations in flight."""
    def rank(o: RankOrder, r: int, chunks: tuple[int, ...]) -> None:
        for _ in range(m):
            o.f(chunks[0])
        for _ in range(m):
            o.bw(chunks[0])
    return _build("gpipe", pp, m, 1, ChunkPlacement.LOOP, rank)


def one_f_one_b(pp: int, m: int, v: int = 1) -> Schedule:
    """PipeDream-flush: P-1-r warm-up forwards, then alternate F and BW, then the remaining BWs."""
    def rank(o: RankOrder, r: int, chunks: tuple[int, ...]) -> None:
        warmup = min(pp - 1 - r, m)
        for _ in range(warmup):
            o.f(chunks[0])
        for _ in range(m - warmup):
            o.f(chunks[0])
            o.bw(chunks[0])
        for _ in range(warmup):
            o.bw(chunks[0])
    return _build("1f1b", pp, m, 1, ChunkPlacement.LOOP, rank)


def rounds(pp: int, microbatches: int) -> tuple[int, ...]:
    """Interleaved 1F1B's micro-batches a round, round by round.

    R = max(1, M // P) rounds, torch.distributed.pipelining's count, so every round but a lone one
    has at least P micro-batches: a shorter round leaves rank 0 waiting for its next chunk's input
    (measured: idle at P = 2 and 3, deadlock from P = 4 on). Where R does not divide M the rounds differ
    by one, the larger first: the warm-up is sized by the first round and must cover the largest.
    Where R divides M these are torch's equal rounds (Megatron's rounds of P when P divides M).
    """
    count = max(1, microbatches // pp)
    size, larger = divmod(microbatches, count)
    return (size + 1,) * larger + (size,) * (count - larger)


def _round_order(sizes: tuple[int, ...], chunks: tuple[int, ...], backward: bool) -> list[tuple[int, int]]:
    """(chunk, micro-batch) in the order a rank takes them: round by round, each round through the
    rank's chunks (model order forward, reverse backward), each chunk over the round's micro-batches."""
    order, first = [], 0
    for size in sizes:
        order += [(c, mb) for c in (chunks[::-1] if backward else chunks) for mb in range(first, first + size)]
        first += size
    return order


def interleaved_1f1b(pp: int, m: int, v: int) -> Schedule:
    """Megatron-LM's virtual pipeline (Narayanan et al. 2021): micro-batches go round the V chunks of
    a rank in rounds, then 1F1B over virtual micro-batches after (P-1-r)*2 + (V-1)*G warm-up
    forwards, G the first round's size. Megatron's rounds are of P; torch.distributed.pipelining's
    of M // R with R = max(1, M // P), refusing M that R does not divide; `rounds` makes them
    unequal there, so every M runs and the bubble stays (P-1)/(VM+P-1) at M >= P."""
    total = m * v
    sizes = rounds(pp, m)

    def rank(o: RankOrder, r: int, chunks: tuple[int, ...]) -> None:
        warmup = min((pp - 1 - r) * 2 + (v - 1) * sizes[0], total)
        fwd, bwd = _round_order(sizes, chunks, False), _round_order(sizes, chunks, True)
        seq = [Action(c, Op.F, mb) for c, mb in fwd[:warmup]]
        for i in range(total - warmup):
            seq += [Action(fwd[warmup + i][0], Op.F, fwd[warmup + i][1]), Action(bwd[i][0], Op.BW, bwd[i][1])]
        seq += [Action(c, Op.BW, mb) for c, mb in bwd[total - warmup:]]
        o.actions.extend(seq)
    return _build("interleaved-1f1b", pp, m, v, ChunkPlacement.LOOP, rank)


def looped_bfs(pp: int, m: int, v: int) -> Schedule:
    """Breadth-first (Lamy-Poirier 2023): each local chunk forwards all micro-batches before the next;
    backwards run chunk by chunk in reverse. V*M activations in flight, fewest weight reloads."""
    def rank(o: RankOrder, r: int, chunks: tuple[int, ...]) -> None:
        for c in chunks:
            for _ in range(m):
                o.f(c)
        for c in reversed(chunks):
            for _ in range(m):
                o.bw(c)
    return _build("looped-bfs", pp, m, v, ChunkPlacement.LOOP, rank)


def zb_h1(pp: int, m: int, v: int = 1) -> Schedule:
    """ZB-H1 (Qi et al. 2024, sec. 2.1): 1F1B's P-1-r warm-up forwards with B and W split, rank r
    deferring its W passes by r so every rank holds P micro-batches in flight (1F1B's peak) while
    the deferred Ws fill the cool-down bubble: idle (P-1)(F+B-W) instead of (P-1)(F+B+W)."""
    def rank(o: RankOrder, r: int, chunks: tuple[int, ...]) -> None:
        c = chunks[0]
        warmup = min(pp - 1 - r, m)
        for _ in range(warmup):
            o.f(c)
        for k in range(m - warmup):
            o.f(c)
            o.b(c)
            if k >= r:
                o.w()
        for _ in range(warmup):
            o.b(c)
            o.w()
    return _build("zb-h1", pp, m, 1, ChunkPlacement.LOOP, rank)


def zb_h2(pp: int, m: int, v: int = 1) -> Schedule:
    """ZB-H2 (Qi et al. 2024, sec. 2.2): every rank may hold up to 2P-1 micro-batches in flight; at
    equal F, B, W times each rank runs, whenever it is free, a B if one is ready, else an F if its
    memory allows, else a deferred W. Played on unit times this rule writes the paper's order: extra
    warm-up forwards fill the wait for the first B, and Ws fill the tail, so with the optimizer
    step post-validated (no barrier) the bubble is (P-1)(F+B-2W) = 0; a synchronous step keeps the
    forward ramp (P-1)F."""
    limit = 2 * pp - 1
    next_f, next_b, in_flight = [0] * pp, [0] * pp, [0] * pp
    f_end: dict[tuple[int, int], int] = {}
    b_end: dict[tuple[int, int], int] = {}
    orders = [RankOrder(m) for _ in range(pp)]
    t, left = 0, 3 * pp * m
    while left:
        for r, o in enumerate(orders):
            mb_b, mb_f = next_b[r], next_f[r]
            if mb_b < m and f_end.get((r, mb_b), t + 1) <= t and (r == pp - 1 or b_end.get((r + 1, mb_b), t + 1) <= t):
                o.b(r)
                b_end[(r, mb_b)] = t + 1
                next_b[r] += 1
            elif mb_f < m and in_flight[r] < limit and (r == 0 or f_end.get((r - 1, mb_f), t + 1) <= t):
                o.f(r)
                f_end[(r, mb_f)] = t + 1
                next_f[r] += 1
                in_flight[r] += 1
            elif o.pending_w:
                o.w()
                in_flight[r] -= 1
            else:
                continue
            left -= 1
        t += 1
    return Schedule("zb-h2", pp, m, 1, ChunkPlacement.LOOP, tuple(tuple(o.actions) for o in orders))


def zb_v(pp: int, m: int, v: int = 2) -> Schedule:
    """ZB-V (Qi et al., arXiv 2405.15362): two chunks a rank in a V, so the last chunk sits on rank 0
    beside the first; near-zero bubble at F=B=W with 1F1B's activation memory (2P half-size chunks).
    Any M >= 1 runs: with M < 2P the phases ask for micro-batches that do not exist and RankOrder
    skips them (torch.distributed.pipelining likewise drops them), leaving a shorter valid order."""
    def rank(o: RankOrder, r: int, chunks: tuple[int, ...]) -> None:
        down, up = chunks  # chunk r (model going down the ranks) and chunk 2P-1-r (coming back)
        for _ in range(2 * (pp - r) - 1):
            o.f(down)
        for _ in range(r):
            o.f(up)
            o.f(down)
        for _ in range(pp - r):
            o.f(up)
            o.b(up)
            o.w()
        for _ in range(m - pp):  # steady: one F, B, W of each chunk (surplus F of `down` skipped)
            o.f(down)
            o.b(down)
            o.w()
            o.f(up)
            o.b(up)
            o.w()
        for _ in range(r):
            o.b(down)
            o.b(up)
        for _ in range(pp - r):
            o.b(down)
            o.w()
    return _build("zb-v", pp, m, 2, ChunkPlacement.V_SHAPE, rank)


def dualpipe_v(pp: int, m: int, v: int = 2) -> Schedule:
    """DualPipeV (DeepSeek-V3's DualPipe folded onto a V, as torch.distributed.pipelining names it).

    Eight phases; where DualPipe overlaps a forward of one chunk with a backward of the other ("F&B"),
    this order lists the pair F then BW (the overlap is a kernel-level matter the runtime may exploit).
    """
    def rank(o: RankOrder, r: int, chunks: tuple[int, ...]) -> None:
        down, up = chunks
        for _ in range(2 * (pp - r - 1)):  # 1: fill the way down
            o.f(down)
        for _ in range(r + 1):  # 2: both chunks forward
            o.f(down)
            o.f(up)
        for _ in range(pp - r - 1):  # 3: first backwards of the returning chunk, Ws deferred
            o.b(up)
            o.w()
            o.f(up)
        for _ in range(m - 2 * pp + r + 1):  # 4: steady F&B pairs on both chunks
            o.f(down)
            o.bw(up)
            o.f(up)
            o.bw(down)
        for _ in range(pp - r - 1):  # 5: the way down runs out of forwards
            o.bw(up)
            o.f(up)
            o.bw(down)
        split = False
        for i in range(r + 1):  # 6: drain the returning chunk, then split B/W halfway
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            o.b(up) if split else o.bw(up)
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            o.b(down) if split else o.bw(down)
        for _ in range(pp - r - 1):  # 7: remaining backwards of the first chunk, filling with Ws
            o.w()
            o.b(down) if split else o.bw(down)
        # 8: the deferred Ws (drained by _build)
    return _build("dualpipe-v", pp, m, 2, ChunkPlacement.V_SHAPE, rank)


def _v_half_block(pp: int, r: int, gap: int) -> dict[int, tuple[int, Op]]:
    """V-Half's building block on rank r: micro-batch 0's four F and B passes, slot -> (which of the
    rank's two chunks, 0 going down the V and 1 coming back, op). A slot is one chunk pass at F = B = W.

    Going down the V (chunk r's forward, then chunk r's backward on the way home) a micro-batch
    moves one rank every two slots, coming back up every slot, where 1F1B's block moves every slot
    both ways. Chunk r is held from slot 2r to 6P-2+gap-r and chunk 2P-1-r from 3P-2-r to
    3P-1+gap+2r: 6P+2*gap-1 slots together on every rank, so with a block every six slots a rank
    holds about P chunks = P/2 stages of activations (plus the W lag), where 1F1B's rank 0 holds P.
    """
    return {2 * r: (0, Op.F), 3 * pp - 2 - r: (1, Op.F), 3 * pp - 1 + gap + 2 * r: (1, Op.B),
            6 * pp - 2 + gap - r: (0, Op.B)}


def v_half(pp: int, m: int, v: int = 2) -> Schedule:
    """V-Half (Qi, Wan, Huang, Lin 2024, "Pipeline Parallelism with Controllable Memory", arXiv
    2405.15362): ZB-V's placement with a building block that lives half as long, so half 1F1B's
    activations ((P+2)//2 stages at the peak against 1F1B's P) and, at F = B = W, less bubble.

    Built as the paper builds it: each rank's block (`_v_half_block`) is repeated every six slots,
    a micro-batch bringing six passes (F, B, W of two chunks), the four F and B passes landing on
    distinct slots modulo 6 and the two slots left running the oldest deferred W. Ranks then play
    that order as soon as their inputs allow (the paper's squeezing), which closes the warm-up's
    and cool-down's holes. The blocks never collide and each respects its own dependencies, so the
    order is deadlock-free for any M >= 1 (fewer blocks, the same rule). `gap` idles rank 0 between
    the returning chunk's forward and backward just enough to keep the residues apart: modulo 6
    the four passes differ by amounts that depend only on the parities of P and r, which leave
    {3, 4} for even P and {0, 1} for odd P; the smallest is taken.
    """
    gap = 3 if pp % 2 == 0 else 0

    def rank(o: RankOrder, r: int, chunks: tuple[int, ...]) -> None:
        block = _v_half_block(pp, r, gap)
        for slot in range(max(block) + 6 * (m - 1) + 1):
            start = next((s for s in block if s <= slot and (slot - s) % 6 == 0 and (slot - s) // 6 < m), None)
            if start is None:
                o.w()  # a slot no block fills: the oldest deferred weight gradient, if any
                continue
            which, op = block[start]  # RankOrder numbers micro-batches in order, as the blocks come
            (o.f if op is Op.F else o.b)(chunks[which])
    return _build("v-half", pp, m, 2, ChunkPlacement.V_SHAPE, rank)
