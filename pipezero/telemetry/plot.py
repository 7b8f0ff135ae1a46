"""Draw a simulated or measured per-rank timeline as a PNG (matplotlib, no display needed)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from pipezero.files import atomic_write_with  # noqa: E402

COLOURS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868", "BW": "#C44E52"}


def draw_timeline(bars: Iterable[tuple[int, str, int, float, float]], n_ranks: int, title: str,
                  path: str | Path, time_unit: str = "F units") -> None:
    """`bars` are (rank, op, micro-batch, start, end); one row a rank, micro-batch numbers on the bars."""
    bars = list(bars)
    end = max((b[4] for b in bars), default=1.0)
    fig, ax = plt.subplots(figsize=(min(24, 4 + 0.35 * len(bars) / max(1, n_ranks)), 0.6 * n_ranks + 1.4))
    for rank, op, mb, start, stop in bars:
        ax.barh(rank, stop - start, left=start, height=0.8, color=COLOURS.get(op, "grey"), edgecolor="black",
                linewidth=0.4)
        if (stop - start) / end > 0.012:
            ax.text((start + stop) / 2, rank, str(mb), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(n_ranks), [f"rank {r}" for r in range(n_ranks)])
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.set_xlabel(time_unit)
    ax.set_title(title)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], loc="upper right", ncol=4, fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def save_figure(fig: plt.Figure, path: str | Path) -> None:
    """Write `fig` to `path` whole or not at all (a temporary file renamed over it, files.atomic_write_with):
    a failed or interrupted drawing leaves whatever was at `path`. The format follows the suffix."""
    try:
        atomic_write_with(path, lambda tmp: fig.savefig(tmp, dpi=110, format=Path(path).suffix[1:] or "png"))
    finally:
        plt.close(fig)


COMM_COLOURS = {"UNSHARD": "#8172B3", "REDUCE_GRAD": "#937860", "OPTIM_STEP": "#DA8BC3"}


def draw_program_timeline(compute: Iterable[tuple[int, str, int, float, float]],
                          comm: Iterable[tuple[int, str, float, float]], n_ranks: int, title: str,
                          path: str | Path, time_unit: str = "F units") -> None:
    """A lowered program's play: for each rank a compute row (`compute` as in draw_timeline; the
    optimizer step has micro-batch -1) and below it a thinner, hatched row of its collectives
    (`comm`: rank, kind, start, end), so gathers and reductions show where they overlap compute
    and where compute waits for them."""
    compute, comm = list(compute), list(comm)
    end = max([b[4] for b in compute] + [b[3] for b in comm], default=1.0)
    fig, ax = plt.subplots(figsize=(min(24, 4 + 0.35 * len(compute) / max(1, n_ranks)), 1.0 * n_ranks + 1.6))
    colours = {**COLOURS, "OPTIM_STEP": COMM_COLOURS["OPTIM_STEP"]}
    for rank, op, mb, start, stop in compute:
        ax.barh(rank, stop - start, left=start, height=0.55, color=colours.get(op, "grey"), edgecolor="black",
                linewidth=0.4)
        if mb >= 0 and (stop - start) / end > 0.012:
            ax.text((start + stop) / 2, rank, str(mb), ha="center", va="center", fontsize=7, color="white")
    for rank, kind, start, stop in comm:
        ax.barh(rank + 0.4, stop - start, left=start, height=0.22, color=COMM_COLOURS.get(kind, "grey"),
                edgecolor="black", linewidth=0.3, hatch="///")
    ax.set_yticks(range(n_ranks), [f"rank {r}" for r in range(n_ranks)])
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.set_xlabel(time_unit)
    ax.set_title(title)
    handles = [Patch(color=c, label=k) for k, c in COLOURS.items()]
    handles += [Patch(facecolor=c, edgecolor="black", hatch="///", label=k.lower().replace("_", " "))
                for k, c in COMM_COLOURS.items()]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=7, fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
