"""Sharded checkpoints (torch.distributed.checkpoint), resume, resharding between layouts, export."""

from pipezero.checkpoint.state import checkpoint_root, resume, save, saves_after
from pipezero.checkpoint.store import CheckpointError, committed, latest

__all__ = ["CheckpointError", "checkpoint_root", "committed", "latest", "resume", "save", "saves_after"]
