"""One spawned 2-rank job for both micro-batch files (``test_micro_batch_auto``: the injected-OOM
choice; ``test_oom_split``: the safety net): a spawn and DeepSpeed's import cost seconds each,
so the job runs once per test session and each file asserts on its part of the results."""

from __future__ import annotations

import functools
from typing import Any

from accumix.testing import spawn


def _job(cases: dict[str, tuple[str, ...]], strategies: list[str]) -> dict[str, Any]:
    from tests.distributed import test_micro_batch_auto as auto
    from tests.distributed import test_oom_split as split
    from tests.frozen_heap import frozen_heap

    split_results = split.job(strategies)  # first: the auto job ends on a refused set-up
    # Every import is done (DeepSpeed's too, by the split job): the probes' garbage passes
    # see only the auto job's objects.
    with frozen_heap():
        return {"split": split_results, "auto": auto.job(cases)}


@functools.cache
def results() -> tuple[dict[str, Any], ...]:
    """Each rank's ``{"auto": ..., "split": ...}``."""
    from tests.distributed import test_micro_batch_auto as auto
    from tests.distributed import test_oom_split as split

    return tuple(spawn(_job, nprocs=2, args=(auto.CASES, split.STRATEGIES), timeout=420))
