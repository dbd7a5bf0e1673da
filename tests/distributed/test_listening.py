"""Issue 45: a job whose ranks meet on loopback listens on loopback only, also when rank 0
hosts the store itself (``env://``, no torchrun agent: ``accumix.testing.spawn``, a user's
``mp.spawn``). Runs in the 2-rank spawn the distributed tests share (``shared_spawn``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.shared_spawn import shared_result
from tests.listening import is_loopback, listening


def _job() -> dict[str, Any]:
    import torch

    import accumix as ax

    acc = ax.Accelerator(strategy="ddp", precision="fp32")
    total = acc.reduce(torch.tensor(1.0), "sum").item()
    return {"rank": acc.rank, "sum": total, "listening": listening([os.getpid()]),
            "port": int(os.environ["MASTER_PORT"]),
            "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME")}


def shared_job(_: Path) -> tuple[Any, tuple[Any, ...]]:
    """This module's job, run in the spawn it shares with other modules (conftest.py)."""
    return _job, ()


@pytest.fixture(scope="module")
def results(shared_spawn: dict[str, list[Any]]) -> list[dict[str, Any]]:
    return shared_result(shared_spawn, __name__)


def test_rank_zeros_store_and_gloo_listen_on_loopback_only(
        results: list[dict[str, Any]]) -> None:
    """Before: rank 0's store listened on ``::`` (every interface)."""
    assert [(r["rank"], r["sum"]) for r in results] == [(0, 2.0), (1, 2.0)]
    store = ("127.0.0.1", results[0]["port"])
    assert store in results[0]["listening"], results[0]["listening"]
    assert all(r["listening"] and all(is_loopback(a) for a, _ in r["listening"])
               for r in results), results
    assert {r["gloo_ifname"] for r in results} == {"lo"}
