"""What the ranks of one ``accumix launch`` tell it about a pre-emption: whether each armed a
handler, and whether each saved.

torchrun's agent turns a signal into an exception once it has forwarded the signal and waited
for the ranks, without their exit statuses; the launcher exited 143 ("pre-empted") even when
the ranks had crashed instead of saving (issue 38), and a scheduler requeued a job whose stop
left no checkpoint. So the launcher names a directory (``ENV``), and each rank's pre-emption
handler writes a file there when it is armed and another when its save is published, under
the agent's restart count (an earlier attempt's save is not this one's). Torch-free: the
launcher reads it before any rank has imported anything.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ENV = "ACCUMIX_PREEMPTION_REPORT"


@dataclass(kw_only=True, frozen=True, slots=True)
class Report:
    """The newest attempt's ranks: those with a handler armed, and the checkpoint each saved."""

    armed: frozenset[int] = frozenset()
    saved: dict[int, str] = field(default_factory=dict)


def _attempt_dir() -> Path | None:
    directory = os.environ.get(ENV)
    if not directory:
        return None
    path = Path(directory) / os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    path.mkdir(parents=True, exist_ok=True)
    return path


def note_armed(rank: int) -> None:
    """A rank's handler is armed (a no-op outside ``accumix launch``)."""
    path = _attempt_dir()
    if path is not None:
        (path / f"armed-{rank}").write_text("")


def note_disarmed(rank: int) -> None:
    """A rank's handler closed before any signal (a no-op outside ``accumix launch``)."""
    path = _attempt_dir()
    if path is not None:
        (path / f"armed-{rank}").unlink(missing_ok=True)


def note_saved(rank: int, checkpoint: str) -> None:
    """A rank's pre-emption save is published (a no-op outside ``accumix launch``)."""
    path = _attempt_dir()
    if path is not None:
        (path / f"saved-{rank}.tmp").write_text(checkpoint)
        (path / f"saved-{rank}.tmp").rename(path / f"saved-{rank}")


def read(directory: str | os.PathLike[str]) -> Report:
    """The newest attempt's report in ``directory`` (an empty one when no rank wrote)."""
    attempts = [p for p in Path(directory).iterdir() if p.name.isdigit()] if Path(
        directory).is_dir() else []
    if not attempts:
        return Report()
    newest = max(attempts, key=lambda p: int(p.name))
    armed, saved = set(), {}
    for entry in newest.iterdir():
        kind, _, rank = entry.name.partition("-")
        if not rank.isdigit():
            continue
        if kind == "armed":
            armed.add(int(rank))
        elif kind == "saved":
            saved[int(rank)] = entry.read_text()
    return Report(armed=frozenset(armed), saved=saved)


@contextlib.contextmanager
def collect(reports: list[Report]) -> Iterator[None]:
    """Names a directory to the ranks for their reports (``ENV``) while they run, then appends
    what they wrote to ``reports`` (the launcher's side)."""
    previous = os.environ.get(ENV)
    with tempfile.TemporaryDirectory(prefix="accumix-launch-") as directory:
        os.environ[ENV] = directory
        try:
            yield
        finally:
            reports.append(read(directory))
            if previous is None:
                del os.environ[ENV]
            else:
                os.environ[ENV] = previous
