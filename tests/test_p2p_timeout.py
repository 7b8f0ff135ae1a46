"""A peer that never sends makes the waiting rank fail within the timeout, naming rank and operation."""

import pytest
import time

from ranks import run_ranks


def silent_peer(rank: int, world: int, done: str) -> str:
    from pathlib import Path

    from pipezero.runtime.p2p import P2P, Payload, PipelineTimeout
    from pipezero.telemetry.trace import Tracer

    p2p = P2P(rank, {0: 0, 1: 1}, (2, 4), timeout_s=2.0, tracer=Tracer(step=7))
    if rank == 0:
        # stalls, never sending the activation, until its peer's wait has ended: a stall of fixed
        # seconds ended first on a loaded machine where the peer's wait began late, and its process
        # gone is another failure than the timeout under test
        deadline = time.monotonic() + 60
        while not Path(done).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return "stalled"
    t0 = time.monotonic()
    try:
        p2p.post_recv(Payload.ACT, 1, 5)  # as a program's RECV posts it, before the action reading it
        p2p.recv(Payload.ACT, 1, 5)
    except PipelineTimeout as e:
        return f"{time.monotonic() - t0:.1f}s|{e}"
    finally:
        Path(done).touch()
    return "received?"


@pytest.mark.distributed
def test_silent_peer_times_out_with_named_operation(tmp_path):
    stalled, message = run_ranks(silent_peer, 2, str(tmp_path / "waited"), timeout=90)
    assert stalled == "stalled"
    took, text = message.split("|", 1)
    assert float(took[:-1]) < 10
    assert "rank 1, step 7: chunk 1 waiting for activation of micro-batch 5 from rank 0" in text


def departed_peer(rank: int, world: int) -> str:
    import torch.distributed as dist

    from pipezero.parallel.waits import PipelineTimeout, gather_objects

    # both sides of the group connected first: a peer gone while gloo still builds its connections
    # fails the group's start on rank 0 (connectFullMesh), not the gather under test
    dist.barrier()
    if rank == 1:
        return "left"  # its process ends without joining the gather
    t0 = time.monotonic()
    try:
        gather_objects({"rank": rank}, "rank 0: end of run: every rank's figures for summary.json")
    except PipelineTimeout as e:
        return f"{time.monotonic() - t0:.1f}s|{e}"
    return "gathered?"


@pytest.mark.distributed
def test_an_object_gather_whose_peer_left_fails_naming_the_operation():
    """summary.json's and a non-finite step's gathers have no async form: a peer that is gone fails
    them with the operation named, not a bare gloo error."""
    message, left = run_ranks(departed_peer, 2, timeout=90)
    assert left == "left"
    took, text = message.split("|", 1)
    assert float(took[:-1]) < 60
    assert text.startswith("rank 0: end of run: every rank's figures for summary.json: failed after"), text
