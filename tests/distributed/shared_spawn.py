"""One 2-rank spawn for several test modules (``tests/distributed/conftest.py``'s fixture).

A spawn costs seconds, and so do the first Accelerator's imports (DCP, the process group) and
deepspeed's import: modules whose checks are each one job share one job here and pay them once.
A module takes part by defining ``shared_job(tmp: Path) -> (fn, args)``.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import pytest

SharedJob = tuple[Callable[..., Any], tuple[Any, ...]]


def run_jobs(jobs: dict[str, SharedJob]) -> dict[str, tuple[bool, Any]]:
    """Runs each module's ``fn(*args)`` in turn on this rank: ``(True, result)`` or ``(False,
    its traceback)``, by module name."""
    out: dict[str, tuple[bool, Any]] = {}
    for name, (fn, args) in jobs.items():
        try:
            out[name] = (True, fn(*args))
        except Exception:  # noqa: BLE001 - one module's failure is its own tests' failure
            out[name] = (False, traceback.format_exc())
    return out


def shared_result(results: dict[str, list[Any]], module: str) -> list[Any]:
    """One module's result on each rank, from the ``shared_spawn`` fixture; a rank's traceback
    fails the test."""
    for ok, value in results[module]:
        if not ok:
            pytest.fail(f"{module}'s shared job raised:\n{value}", pytrace=False)
    return [value for _, value in results[module]]
