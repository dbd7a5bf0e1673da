"""``common/agreed_failure.run_and_agree``: every rank raises the lowest failing rank's error, or
none does (the save's steps and the Ray hand-off; each rank's view simulated by its gather)."""

from __future__ import annotations

import pytest

from accumix.common.agreed_failure import run_and_agree
from accumix.errors import CheckpointError


def _disk_full() -> None:
    raise OSError("disk full")


def test_a_rank_that_did_not_fail_raises_the_failed_ranks_error() -> None:
    gathered = []

    def gather(error: str | None) -> list[str | None]:  # rank 0's view: rank 1 failed
        gathered.append(error)
        return [error, "OSError: disk full"]

    with pytest.raises(CheckpointError) as info:
        run_and_agree(gather, lambda: None, "writing step-3/rank-*.pt")
    assert gathered == [None]  # its own step ran and succeeded
    assert str(info.value) == "writing step-3/rank-*.pt failed on rank 1: OSError: disk full"


def test_the_lowest_failing_rank_is_named_and_its_own_error_is_gathered() -> None:
    gathered = []

    def gather(error: str | None) -> list[str | None]:  # rank 2 of 3; ranks 1 and 2 failed
        gathered.append(error)
        return [None, "ValueError: bad", error]

    with pytest.raises(CheckpointError, match=r"^linking failed on rank 1: ValueError: bad$"):
        run_and_agree(gather, _disk_full, "linking")
    assert gathered == ["OSError: disk full"]


def test_no_failure_raises_nothing_and_a_rank_without_a_part_still_gathers() -> None:
    gathered = []

    def gather(error: str | None) -> list[str | None]:
        gathered.append(error)
        return [None, None]

    ran = []
    run_and_agree(gather, lambda: ran.append(1), "publishing")
    run_and_agree(gather, None, "publishing")
    assert ran == [1] and gathered == [None, None]
