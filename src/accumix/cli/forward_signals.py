"""The launcher passes SLURM's warning signals on to its ranks.

``#SBATCH --signal=USR1@90`` signals the job step's task, which is ``accumix launch``: torchrun's
agent does not handle SIGUSR1/SIGUSR2 and their default action would end it, while its ranks,
each in a session of its own, are not in the process group SLURM signals. While the ranks run,
the launcher sends them every SIGUSR1/SIGUSR2 it gets (a rank saves at its next boundary when
it watches that signal: ``preemption_signals``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

WARNING_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def child_pids() -> list[int]:
    """This process's children (Linux ``/proc``; elsewhere none): the agent's ranks."""
    pids: list[int] = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return pids
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/children") as children:
                pids += [int(pid) for pid in children.read().split()]
        except OSError:
            continue  # the thread exited meanwhile
    return pids


@contextlib.contextmanager
def forwarding_warning_signals() -> Iterator[None]:
    """While the ranks run, SIGUSR1/SIGUSR2 sent to the launcher go on to every rank (which
    saves at its next boundary when it watches that signal: ``preemption_signals``)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, frame: Any) -> None:
        for pid in child_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in WARNING_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
