"""One step of a collective operation, then every rank learns whether any rank failed.

A save is a sequence of steps each rank runs on its own (write its files, link them for Ray)
between collectives. A rank whose step raised must not leave the others waiting in the next
collective it never reaches: every rank runs its step, catches its error as a string, and the
ranks all-gather those strings; then each raises the first failure, naming its rank, or none
does. Torch-free: the caller passes its all-gather (the strategy's, a background thread's
group, Ray's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from accumix.errors import CheckpointError

Gather = Callable[[Any], list[Any]]  # all_gather_object: collective, rank order


def run_and_agree(gather: Gather, fn: Callable[[], None] | None, what: str) -> None:
    """Runs ``fn`` here (None: nothing to run on this rank), then all-gathers whether it failed.

    Args:
        gather: the all-gather of one picklable value per rank, in rank order.
        fn: this rank's part of the step.
        what: the step, for the message ("writing the models and optimizers").

    Raises:
        CheckpointError: on every rank when any rank's ``fn`` raised: "``what`` failed on rank
            R: <the exception>", R the lowest rank that failed.
    """
    error = None
    if fn is not None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            error = f"{type(exc).__name__}: {exc}"
    failed = [(r, e) for r, e in enumerate(gather(error)) if e is not None]
    if failed:
        rank, message = failed[0]
        raise CheckpointError(f"{what} failed on rank {rank}: {message}")
