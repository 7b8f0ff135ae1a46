"""`pipezero` as one torchrun worker with a fault injected, for the failure tests.

PIPEZERO_TEST_FAULT = "kill:RANK:STEP": that rank SIGKILLs itself at the start of its first backward
of STEP (mid-step: its peers are blocked on it), on the first attempt only, so torchrun's elastic
agent restarts the job. "silent:RANK:STEP": that rank stops sending from STEP on (it hangs
instead), so its peers must time out.
"""

import os
import signal
import sys
import time

from pipezero.cli import main
from pipezero.runtime.p2p import P2P
from pipezero.zero.sharded import ZeroDP

kind, rank, at = os.environ["PIPEZERO_TEST_FAULT"].split(":")
if int(os.environ["RANK"]) == int(rank) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    if kind == "kill":
        clean_backward = ZeroDP.before_backward

        def before_backward(self, *args, **kwargs):
            if self.step_no == int(at):
                os.kill(os.getpid(), signal.SIGKILL)
            clean_backward(self, *args, **kwargs)

        ZeroDP.before_backward = before_backward
    elif kind == "silent":
        clean_send = P2P.send

        def send(self, *args, **kwargs):
            if self.tracer.step >= int(at):
                time.sleep(3600)
            clean_send(self, *args, **kwargs)

        P2P.send = send

sys.exit(main())
