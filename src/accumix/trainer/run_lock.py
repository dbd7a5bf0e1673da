"""One live job per run directory: an exclusive ``flock`` on ``run_dir/.lock``.

Two jobs writing one run directory (a restart while the first job's workers still train, two
submissions of one config) interleave checkpoints, ``latest``, ``metrics.csv`` and one tracker
run. The Trainer's main process holds the lock from the start of ``fit`` to its end; the kernel
drops it when that process dies, however it dies, so a killed job never leaves a stale lock
(the file stays, holding the last holder's pid for the message).

A ``flock`` belongs to the open file, which a ``fork`` shares: the lock lived on in forked
DataLoader workers after a SIGKILL of the main process until they noticed (about 5 s), and a
restart meanwhile was refused naming the dead pid (issue 38). ``O_CLOEXEC`` does not reach a
fork without exec, and an ``F_SETLK`` record lock would not refuse a second job in the same
process; so a forked child closes its copies of the held descriptors at once
(``os.register_at_fork``). Closing a copy never releases the lock (an explicit unlock would:
the child never unlocks), and the parent's descriptor alone keeps it.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

from accumix.common.safe_write import open_fd
from accumix.errors import ConfigError

log = logging.getLogger("accumix")

LOCK_FILE = ".lock"
_held_fds: set[int] = set()  # descriptors of the locks this process holds


def _close_held_in_child() -> None:
    for fd in _held_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    _held_fds.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_held_in_child)


class RunDirLock:
    """The held lock of one run directory; ``release()`` (or the process's end) frees it."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    def release(self) -> None:
        """Frees the lock (the file stays: removing it would race a job that opened it)."""
        if self._fd < 0:
            return
        import fcntl

        _held_fds.discard(self._fd)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = -1


def lock_run_dir(run_dir: Path) -> RunDirLock | None:
    """Takes ``run_dir``'s lock for this process (None where ``fcntl`` is missing, Windows,
    or the filesystem cannot lock: a warning says so).

    Raises:
        ConfigError: another live process holds it (named by its pid and host), or the
            directory cannot be written.
    """
    try:
        import fcntl
    except ImportError:
        return None
    path = run_dir / LOCK_FILE
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        # Not through a link planted at .lock (it would be truncated and overwritten below).
        fd = open_fd(path, read=True, permissions=0o644)
    except OSError as exc:
        raise ConfigError(f"run directory {str(run_dir)!r} cannot be written ({exc.strerror}); "
                          "give a writable one") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise ConfigError(
            f"run directory {str(run_dir)!r} is in use by a live job ({holder}); wait for it "
            "to end (or stop it), or give this job another run directory (output_dir=)"
        ) from None
    except OSError as exc:  # a filesystem without flock (some network mounts): no guard
        os.close(fd)
        log.warning("run directory %s cannot be locked (%s): a second job there would not be "
                    "refused", run_dir, exc.strerror)
        return None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    _held_fds.add(fd)
    return RunDirLock(path, fd)


def check_run_dir_free(run_dir: Path) -> None:
    """Raises the ``lock_run_dir`` error now if a live job holds ``run_dir`` (takes the lock
    and gives it back: for a launcher, before it starts any worker)."""
    if not (run_dir / LOCK_FILE).exists():
        return
    held = lock_run_dir(run_dir)
    if held is not None:
        held.release()
