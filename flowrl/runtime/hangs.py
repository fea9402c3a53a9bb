"""Where a stuck worker is stuck: the Python stack of every thread, taken inside the worker.

When the watchdog (:mod:`flowrl.runtime.watchdog`) finds a task past its
timeout, the driver asks that worker for its stacks through the backend
(:meth:`~flowrl.runtime.backend.Backend.stacks`: a Ray actor answers on a
control thread of its own while its task thread is stuck; the local backend
reads its pool's thread). The error then shows the file, line and function
the task is in. A worker that cannot answer (stopped by SIGSTOP, or stuck
outside Python with the interpreter lock held) is named as such, with its
process state when it runs on this machine.

Example::

    print(thread_stacks())                      # every thread of this process
    print(thread_stacks(names=("flowrl-critic0",)))
"""

from __future__ import annotations

import sys
import threading
import traceback
from pathlib import Path

#: how long the driver waits for a stuck worker's stacks
STACKS_TIMEOUT_S = 5.0
#: the frames of a stack kept (innermost): enough to see the operator under the runtime
MAX_FRAMES = 40


def thread_stacks(names: tuple[str, ...] | None = None, skip_current: bool = True) -> str:
    """Every thread's Python stack (innermost call last), or only threads whose name starts with one of ``names``."""
    by_id = {t.ident: t for t in threading.enumerate()}
    me = threading.get_ident()
    out = []
    for ident, frame in sys._current_frames().items():
        thread = by_id.get(ident)
        name = thread.name if thread is not None else f"thread {ident}"
        if (skip_current and ident == me) or (names is not None and not name.startswith(names)):
            continue
        stack = "".join(traceback.format_stack(frame)[-MAX_FRAMES:])
        out.append(f'Thread "{name}" (id {ident}):\n{stack}')
    return "\n".join(out) or "(no matching thread)"


def process_state(pid: int | None) -> str:
    """A process's state from /proc when it runs on this machine (``stopped``, ``sleeping``...), else ''."""
    if not pid:
        return ""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        return ""
    return ""


def unanswered(label: str, pid: int | None, waited_s: float) -> str:
    """What to say when a worker did not send its stacks within ``waited_s``."""
    state = process_state(pid)
    why = ("it is stopped (SIGSTOP or a debugger): send SIGCONT, or end it" if state.startswith("T")
           else "it is stuck outside Python (native code holding the interpreter lock, or a collective)")
    return (f"{label} did not answer for its stacks within {waited_s:g}s"
            + (f" (process state: {state})" if state else "") + f": {why}")


__all__ = ["MAX_FRAMES", "STACKS_TIMEOUT_S", "process_state", "thread_stacks", "unanswered"]
