"""The processes of a local job die with the process that started them, whatever ends it.

`kill -9` of the `--nproc` launcher runs none of its code: without this, torchrun's agent and every
rank trained on as orphans while the run folder's lock, held by the launcher, was gone, and a
`--resume` into the folder was let in beside them (two jobs writing one folder). Two guarantees,
each enough alone for what the user sees, together robust:

- each level asks the kernel for SIGKILL when its parent dies (Linux `PR_SET_PDEATHSIG`): the
  launcher's death ends the agent, the agent's ends its ranks, within milliseconds. The kernel does
  it, so no code of the dying process needs to run (a watchdog thread polling a pid would, and
  would be late). The setting is made by the child itself and then its parent's pid is checked: a
  parent that died before the setting took is seen at once, with no window.
- the run folder's lock descriptor is inherited by the agent and every rank (one open file
  description: `flock` holds while any process keeps it open), so the folder stays claimed while
  any rank of the run lives, even in the instant between its launcher's death and its own.

Where `PR_SET_PDEATHSIG` is missing (not Linux) only the inherited lock remains.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import MutableMapping

PARENT = "PIPEZERO_DIE_WITH"  # the pid of the process a child must not outlive, set by its parent
LOCK_FD = "PIPEZERO_LOCK_FD"  # the run folder's lock descriptor, inherited down to the ranks
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def bind_child(env: MutableMapping[str, str], lock_fd: int | None = None) -> tuple[int, ...]:
    """Mark `env` (a child's environment) so the child dies with this process and keeps `lock_fd`
    open; the descriptors to pass the child (Popen's `pass_fds`)."""
    env[PARENT] = str(os.getpid())
    if lock_fd is None:
        env.pop(LOCK_FD, None)
        return ()
    env[LOCK_FD] = str(lock_fd)
    return (lock_fd,)


def die_with_parent(env: MutableMapping[str, str] = os.environ) -> None:
    """In a child bound by `bind_child`: end this process when that parent ends (or now, if it already
    has). Does nothing in a process nobody bound, so a rank started by an outside torchrun or srun
    keeps their own rules."""
    text = env.pop(PARENT, "")
    if not text.isdigit():
        return
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)  # the process's own symbols, libc's prctl among them (find_library runs ldconfig)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return  # refused (a sandbox): the inherited lock still keeps the folder claimed
    if os.getppid() != int(text):  # the parent died before the setting took: adopted by init already
        os._exit(128 + signal.SIGKILL)


def inherited_lock(env: MutableMapping[str, str] = os.environ) -> tuple[int, ...]:
    """The lock descriptor this process was given to keep open (and hand on to its own children), as
    Popen's `pass_fds`; empty when it holds none."""
    text = env.get(LOCK_FD, "")
    if not text.isdigit():
        return ()
    try:
        os.fstat(int(text))
    except OSError:  # not open here: whoever set the variable passed no descriptor
        return ()
    return (int(text),)
