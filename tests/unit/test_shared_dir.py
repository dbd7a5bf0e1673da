"""Which ranks share a run directory (``accumix.common.shared_dir``), three ranks as threads:
two on one directory, one on another; views that do not split the ranks are refused."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from accumix.common.shared_dir import PROBE_PREFIX, _groups, probe
from accumix.errors import CheckpointError


def _probe_as_threads(dirs: list[Path]) -> list[Any]:
    world = len(dirs)
    barrier = threading.Barrier(world)
    slots: list[Any] = [None] * world
    out: list[Any] = [None] * world

    def rank(r: int) -> None:
        def all_gather(obj: Any) -> list[Any]:
            slots[r] = obj
            barrier.wait()
            everyone = list(slots)
            barrier.wait()  # nobody overwrites a slot before every rank has read them all
            return everyone

        try:
            out[r] = probe(dirs[r], rank=r, world_size=world, all_gather=all_gather)
        except Exception as exc:  # noqa: BLE001 - compared below
            out[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return out


def test_groups_leaders_and_no_leftovers(tmp_path: Path) -> None:
    a, b = tmp_path / "node-a" / "run", tmp_path / "node-b" / "run"
    layouts = _probe_as_threads([a, a, b])
    assert [lay.groups for lay in layouts] == [((0, 1), (2,))] * 3
    assert [(lay.leader, lay.is_leader, lay.shared) for lay in layouts] == [
        (0, True, False), (0, False, False), (2, True, False)]
    assert not list(a.glob(f"{PROBE_PREFIX}*")) and not list(b.glob(f"{PROBE_PREFIX}*"))
    shared = _probe_as_threads([a, a, a])
    assert [lay.groups for lay in shared] == [((0, 1, 2),)] * 3 and shared[0].shared


def test_unwritable_directory_and_one_sided_views_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    errors = _probe_as_threads([tmp_path / "ok", blocker / "run"])
    assert all(isinstance(e, CheckpointError) for e in errors), errors
    # Every rank raises, naming the rank that failed and why (the same run_dir string on every
    # rank of a real job; here each thread's own).
    assert all("rank 1 cannot write" in str(e) and "Not a directory" in str(e) for e in errors)
    with pytest.raises(CheckpointError, match=r"rank 0 sees \[0, 1\]; rank 1 sees \[1\]"):
        _groups([[0, 1], [1]], tmp_path)  # a filesystem that shows rank 1's file to rank 0 only
