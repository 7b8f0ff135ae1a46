"""`--tensorboard`: what `metrics.jsonl` records, also as TensorBoard scalars under `OUT/tensorboard`.

The TensorBoard file is a second view of the same records, never a second source of numbers: each
step's line of `metrics.jsonl` (loss, learning rate, gradient norm, tokens/s, step time, the
writing rank's bubble and peak memory, held-out loss on evaluation steps) becomes one scalar a
field, and at the end each rank's measured bubble and peak memory from `summary.json`.
TensorBoard is optional: torch's writer imports it, and a run that asks for it without it installed
stops before any process group starts, with the command that installs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipezero.errors import ConfigError

# metrics.jsonl field -> TensorBoard tag (grouped the way a user reads them)
TAGS = {
    "loss": "train/loss", "heldout_loss": "train/heldout_loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
    "tokens_per_s": "speed/tokens_per_s", "step_time_s": "speed/step_time_s", "bubble": "speed/bubble_rank0",
    "peak_rss_mib": "memory/peak_rss_mib_rank0",
}


def require_tensorboard() -> None:
    """Fail with one clear line when the writer cannot be imported."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        raise ConfigError("--tensorboard needs the tensorboard package: pip install tensorboard") from None


def probe_writable(folder: Path) -> None:
    """Raise the OSError (naming `folder`) of a folder that refuses files: torch's writer opens its
    event file in a thread of its own, whose failure would print a traceback beside our one line."""
    import os
    import tempfile

    from pipezero.files import physical

    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=physical(folder), prefix=".probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(folder)) from None


class TensorBoardLog:
    """Writes each metrics record as scalars at its step (rank 0 only, like metrics.jsonl)."""

    def __init__(self, out: Path) -> None:
        require_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        folder = out / "tensorboard"
        probe_writable(folder)
        self.writer = SummaryWriter(log_dir=str(folder))

    def write(self, record: dict[str, Any]) -> None:
        for key, tag in TAGS.items():
            value = record.get(key)
            if value is not None:  # a skipped step has no loss
                self.writer.add_scalar(tag, value, record["step"])
        self.writer.flush()

    def write_ranks(self, per_rank: list[dict[str, Any]], step: int) -> None:
        """Each rank's measured bubble and peak memory, at the last step."""
        for rank, figures in enumerate(per_rank):
            self.writer.add_scalar(f"ranks/bubble/rank{rank}", figures["measured_bubble"], step)
            self.writer.add_scalar(f"ranks/peak_rss_mib/rank{rank}", figures["peak_rss_bytes"] / 2**20, step)

    def close(self) -> None:
        self.writer.close()
