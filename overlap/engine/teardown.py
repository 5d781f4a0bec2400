"""Leaving a process cleanly: no native thread left holding Python objects when the interpreter
finalizes.

[Note: quiet exit]
A gloo process group runs its collectives on worker threads of its own (C++). When a collective
finishes, the rank that waited on it moves on at once, and the worker drops its references to
the collective's tensors a moment later. Dropping a tensor that has a Python object needs the
GIL. If the rank reached the end of its script in that moment (on a busy machine a worker can
wait tens of milliseconds for a core), the worker asks for the GIL of an interpreter that is
finalizing; CPython before 3.14 then ends the thread with `pthread_exit`, whose unwinding meets a
C++ destructor and calls `std::terminate`: "terminate called without an active exception",
SIGABRT, after all the rank's work was done. torchrun reports the rank as failed and restarts
the job (CI saw it in `test_torchrun_restart_resumes_from_latest_checkpoint`; here about one
run in fifteen of that test's script on two cores, 3 in 42; a core dump showed the worker in `~AsyncBroadcastWork` ->
`decref_pyobject` -> `take_gil` -> `pthread_exit`, the main thread in `Py_FinalizeEx`).

`dist.destroy_process_group()` does not prevent it: the group's threads stop only when the last
reference to the group goes, and DTensor's sharding cache keeps the mesh, and with it the group,
to the end of the process (true of any DTensor program, FSDP2 included).

So at exit, while the interpreter is still whole (an `atexit` hook, registered by `wrap`
through process_hooks.py), two things happen: garbage is collected (a wrapped model that was
dropped lets go of its buffers: [Note: a wrapped model is collectable] in autograd_hooks.py),
and the main thread gives up the GIL in short sleeps until no other thread of the process has
been runnable for two polls in a row: a worker waiting for the GIL gets it during a sleep and
finishes; one waiting for a core shows as runnable and is waited for. The wait is bounded
(`EXIT_WAIT_S`): a thread that stays busy (a spinning BLAS pool, a collective still in flight)
delays exit by at most that.

Before both, the checks that the last step of each wrapped model still alive left unread are
read and logged ([Note: final checks] in late_checks.py): a CUDA run that ends without a
checkpoint would otherwise never hear of a divergence or a NaN block in its last step.
"""

from __future__ import annotations

import atexit
import functools
import gc
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from overlap.engine import process_hooks
from overlap.engine.late_checks import report_at_exit

if TYPE_CHECKING:
    from overlap.engine.state import OverlapState

EXIT_WAIT_S = 2.0
"""The longest `quiet_exit` waits for the process's other threads to go idle."""

POLL_S = 0.005
"""Between two looks at the threads, the main thread sleeps this long without the GIL."""

_TASKS = "/proc/self/task"

_WATCHED: weakref.WeakSet[OverlapState] = weakref.WeakSet()
"""The wrapped models' states whose deferred checks are read at exit (weakly: a dropped model
is collectable, [Note: a wrapped model is collectable] in state.py)."""


def runnable_threads() -> list[int]:
    """Thread ids of this process, other than the caller's, that are running or waiting for a
    core (state R in /proc). Empty where /proc is missing (not Linux): nothing to wait for."""
    me = threading.get_native_id()
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return []
    busy = []
    for tid in tids:
        if int(tid) == me:
            continue
        try:
            with open(f"{_TASKS}/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended between the listing and the read
        # "pid (comm) S ...": comm may hold spaces and parentheses; the state follows the last ')'
        if stat[stat.rindex(")") + 2] == "R":
            busy.append(int(tid))
    return busy


def wait_threads_idle(
    timeout_s: float = EXIT_WAIT_S, poll_s: float = POLL_S, runnable: Callable[[], list[int]] = runnable_threads
) -> bool:
    """Sleep in steps of `poll_s` (the GIL released) until `runnable()` is empty twice in a row;
    True then, False if `timeout_s` passed first."""
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while quiet < 2:
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
        quiet = quiet + 1 if not runnable() else 0
    return True


def quiet_exit() -> None:
    """What runs at exit ([Note: quiet exit]): read the last step's deferred checks, collect
    garbage, then let other threads finish."""
    report_at_exit(list(_WATCHED))
    gc.collect()
    wait_threads_idle()


def watch(state: OverlapState) -> None:
    """Read `state`'s deferred checks at exit, and leave the process quietly; `wrap` calls it."""
    _WATCHED.add(state)
    register()


def register() -> None:
    """Run `quiet_exit` when the interpreter exits; once per process, however often called
    (unless disabled: "exit" in [Note: process-wide hooks] in process_hooks.py)."""
    process_hooks.install("exit", __name__, _install)


def _install() -> process_hooks.Remove:
    atexit.register(quiet_exit)
    return functools.partial(atexit.unregister, quiet_exit)
