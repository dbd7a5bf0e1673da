"""What a forked child (a DataLoader worker) inherits from its rank, issue 38: the run
directory's lock must not outlive a killed main process in it, and a pre-emption signal sent
to the whole job must not kill it while a signal from its own parent still does."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import time
from pathlib import Path

from accumix.common.worker_signals import survive_others
from accumix.trainer.run_lock import lock_run_dir


def _hold(run_dir: Path, pids: mp.Queue) -> None:
    """A job's main process: takes the lock, forks a child that sleeps (a DataLoader worker),
    says the child's pid and waits."""
    held = lock_run_dir(run_dir)
    assert held is not None
    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    pids.put(child)
    time.sleep(60)


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_killed_main_process_leaves_no_lock_in_its_forked_children(tmp_path: Path) -> None:
    """Before: a restart within the children's lifetime was refused ("in use by a live job
    (pid <the dead one>)")."""
    ctx = mp.get_context("fork")  # torch is imported here already: nothing to import
    pids = ctx.Queue()
    main = ctx.Process(target=_hold, args=(tmp_path, pids), daemon=True)
    main.start()
    child = pids.get(timeout=30)
    try:
        main.kill()
        # not join(): the child holds the process's sentinel pipe open too
        deadline = time.monotonic() + 30
        while main.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert main.exitcode == -signal.SIGKILL
        assert _alive(child)  # the forked child lives on, as a DataLoader worker would
        lock = lock_run_dir(tmp_path)  # the restart: refused before
        assert lock is not None
        lock.release()
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def _guarded_child(ready: mp.synchronize.Event) -> None:
    survive_others((signal.SIGTERM,))
    ready.set()
    time.sleep(60)


def test_a_guarded_worker_survives_the_jobs_sigterm_and_not_its_parents() -> None:
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    child = ctx.Process(target=_guarded_child, args=(ready,), daemon=True)
    child.start()
    try:
        assert ready.wait(30)
        # Another process's SIGTERM (torchrun's agent, the scheduler, a kill of the group).
        subprocess.run(["kill", "-TERM", str(child.pid)], check=True)
        time.sleep(0.5)
        assert child.is_alive() and child.exitcode is None
        # Its parent's (the loader's terminate() of a worker that did not stop in time).
        child.terminate()
        child.join(10)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
