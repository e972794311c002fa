"""A child process that dies with its parent: no orphans, whatever stops the parent.

    proc = subprocess.Popen(args, preexec_fn=die_with_parent(), start_new_session=True)
    proc = await asyncio.create_subprocess_exec(*args, preexec_fn=die_with_parent())

Used by every launcher of Switchboard processes: `switchboard up`'s supervisor
(control_plane/supervisor.py), the autoscaler's local actuator (control_plane/scaling/actuators/local.py)
and anything that starts a helper process of its own (pipeline stages, benchmarks).

An orderly parent stops its children itself (SIGTERM, in its order). This is the net for the
parent that cannot: killed with SIGKILL, crashed in native code, or stopped by a signal before it
set its handlers. Linux delivers ``PR_SET_PDEATHSIG`` to the child the moment the parent *thread*
that forked it exits, so fork from the thread that lives as long as the process (the main thread,
or the event loop's); the signal is SIGKILL, because with the parent gone nobody would wait for a
graceful stop, and a SIGTERM'd server may wait on its in-flight streams. The signal survives
``exec`` (prometheus and other foreign programs get it too) and chains: a shard started by a
control plane started by ``switchboard up`` dies when the control plane does. The race (the parent
dies between fork and ``prctl``) is closed by checking the parent pid after setting it.
Elsewhere than Linux ``die_with_parent()`` returns None (nothing is set; the parent's own shutdown
is all there is).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1
"""prctl(2) option: the signal this process gets when its parent thread exits."""


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get `sig` when the process that forked it exits
    (Linux; None elsewhere). Call it in the parent: it records the parent's pid to close the race."""
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()
    libc = ctypes.CDLL(None, use_errno=True)  # loaded here, in the parent: the child only calls it

    def _set() -> None:
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent was already gone when prctl ran
            os.kill(os.getpid(), sig)

    return _set


__all__ = ["PR_SET_PDEATHSIG", "die_with_parent"]
