"""Fixtures for the 2-rank tests."""

from __future__ import annotations

from typing import Any

import pytest

from accumix.testing import spawn
from tests.distributed.shared_spawn import run_jobs


@pytest.fixture(scope="session")
def shared_spawn(request: pytest.FixtureRequest,
                 tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """Each rank's result of ``shared_job`` for every selected module that defines it, from one
    spawn (``shared_spawn.py``), by module name."""
    modules = {item.module.__name__: item.module for item in request.session.items
               if hasattr(getattr(item, "module", None), "shared_job")}
    jobs = {name: modules[name].shared_job(tmp_path_factory.mktemp(name.rpartition(".")[2]))
            for name in sorted(modules)}
    ranks = spawn(run_jobs, 2, (jobs,), timeout=900)
    return {name: [r[name] for r in ranks] for name in jobs}

