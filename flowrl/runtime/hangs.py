"""Where a stuck worker is stuck: the Python stack of every thread, taken inside the worker.

When the watchdog (:mod:`flowrl.recovery.watchdog`) finds a task past its
timeout, the driver asks that worker for its stacks through the backend
(:meth:`~flowrl.runtime.backend.Supervisor.stacks`: a Ray actor answers on a
control thread of its own while its task thread is stuck; the local backend
reads its pool's thread). The error then shows the file, line and function
the task is in. A worker that cannot answer (stopped by SIGSTOP, or stuck
outside Python with the interpreter lock held) is named as such, with its
process state when it runs on this machine.

A rank of a pool's process group heads its stacks with the collective it is
inside, or the last it left (:func:`collective_line`, recorded by
:meth:`~flowrl.runtime.distributed.PoolGroup.guard` as it enters and leaves);
from every rank's stacks the watchdog says which ranks reached the collective
that does not complete and which did not (:func:`collective_summary`).

Example::

    print(thread_stacks())                      # every thread of this process
    print(thread_stacks(names=("flowrl-critic0",)))
"""

from __future__ import annotations

import re
import sys
import threading
import traceback
from pathlib import Path
from typing import Callable

from flowrl.errors import NodeTimeoutError

from flowrl.timeouts import STACKS_S as STACKS_TIMEOUT_S  # how long the driver waits for a worker's stacks

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


_INSIDE = re.compile(r"^collective: rank (\d+) is inside (.+) #(\d+) for ([\d.]+)s$", re.M)
_OUTSIDE = re.compile(r"^collective: rank (\d+) is inside none(?:; it last left (.+) #(\d+))?$", re.M)


def collective_line(rank: int, inside: tuple[int, str, float] | None, left: tuple[int, str] | None) -> str:
    """The head of a rank's stacks: the collective it is ``inside`` (seq, name, seconds in it), else the
    last it ``left`` (seq, name)."""
    if inside is not None:
        return f"collective: rank {rank} is inside {inside[1]!r} #{inside[0]} for {inside[2]:.1f}s\n"
    return f"collective: rank {rank} is inside none" + (f"; it last left {left[1]!r} #{left[0]}" if left else "") + "\n"


def collective_summary(pool: str, stacks: dict[int, str]) -> str:
    """Which ranks of ``pool`` are inside the latest collective any of them entered, and where the others
    are, from every rank's stacks (rank → its :meth:`~flowrl.runtime.backend.Supervisor.stacks` text);
    '' when no rank is inside one."""
    inside = {int(m[1]): (int(m[3]), m[2], float(m[4])) for r, text in stacks.items() for m in _INSIDE.finditer(text)}
    if not inside:
        return ""
    seq, name, _ = max(inside.values())
    arrived = sorted(r for r, (s, _, _) in inside.items() if s == seq)
    others = []
    for rank in sorted(set(stacks) - set(arrived)):
        m = _OUTSIDE.search(stacks[rank])
        if rank in inside:
            others.append(f"rank {rank} (inside an earlier one, {inside[rank][1]} #{inside[rank][0]})")
        elif m is None:
            others.append(f"rank {rank} (no answer: {stacks[rank].strip().splitlines()[0][:200]})")
        else:
            others.append(f"rank {rank} (in no collective" + (f"; it last left {m[2]} #{m[3]}" if m[2] else "") + ")")
    waited = ", ".join(f"{r} (waiting {inside[r][2]:.1f}s)" for r in arrived)
    return (f"collective {name} #{seq} of pool {pool!r}: ranks inside it: {waited}; not inside it: "
            + ("; ".join(others) or "none") + (" — the rank(s) not inside it are the ones to look at" if others
                                                else ""))


def get_within(get: Callable[..., object], handle: object, limit: float | None, what: str) -> object:
    """``get(handle)`` within ``limit`` seconds (None: no limit), else a :class:`NodeTimeoutError` naming ``what``."""
    try:
        return get(handle, timeout=limit)
    except Exception as e:
        if "Timeout" not in type(e).__name__:  # Ray's GetTimeoutError, concurrent.futures' TimeoutError
            raise
        raise NodeTimeoutError(f"{what} did not come within schedule.timeout_s={limit:g}") from None


__all__ = ["MAX_FRAMES", "STACKS_TIMEOUT_S", "collective_line", "collective_summary", "get_within", "process_state",
           "thread_stacks", "unanswered"]
