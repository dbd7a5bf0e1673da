"""Under Ray Train, without a cluster: which files each rank hands to Ray, and which checkpoint a
(re)started worker resumes from (accumix.common.ray_checkpoint), on a storage directory laid
out as Ray leaves it; Ray's context and registered checkpoint are stand-ins."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("ray.train", reason="ray[train] is not installed: pip install "
                    "'accumix[ray]' to run the Ray Train tests")

import ray.train  # noqa: E402
from pyarrow.fs import LocalFileSystem  # noqa: E402

from accumix.common import ray_checkpoint, ray_train  # noqa: E402
from accumix.common.launch_env import detect_launch_env  # noqa: E402


def test_every_file_goes_to_one_rank_that_sees_it_largest_first_to_the_least_loaded() -> None:
    shared = {"model/__0_0.distcp": 100, "model/__1_0.distcp": 90, "model/.metadata": 5,
              "rank-0.pt": 10, "rank-1.pt": 10, "meta.json": 3}
    # A shared filesystem: both see everything and split it.
    shares = ray_checkpoint.assign([shared, shared])
    assert sorted(shares[0] + shares[1]) == sorted(shared)
    assert shares == [["model/__0_0.distcp", "rank-1.pt"],
                      ["model/__1_0.distcp", "rank-0.pt", "model/.metadata", "meta.json"]]
    assert [sum(shared[f] for f in share) for share in shares] == [110, 108]
    # A disk per node, each a whole copy (its own meta.json and .metadata): what only one node
    # holds goes from there; what both hold, from node 0 alone (never one file of each).
    node0 = {"model/__0_0.distcp": 100, "model/.metadata": 5, "rank-0.pt": 10, "meta.json": 3}
    node1 = {"model/__1_0.distcp": 90, "model/.metadata": 6, "rank-1.pt": 10, "meta.json": 4}
    shares = ray_checkpoint.assign([node0, node1])
    assert sorted(shares[0]) == sorted(node0)
    assert sorted(shares[1]) == ["model/__1_0.distcp", "rank-1.pt"]
    # Two ranks per node: each node's ranks split what their node uploads.
    shares = ray_checkpoint.assign([node0, node0, node1, node1])
    assert sorted(shares[0] + shares[1]) == sorted(node0) and shares[0] and shares[1]
    assert sorted(shares[2] + shares[3]) == ["model/__1_0.distcp", "rank-1.pt"]


class _Context:
    def __init__(self, root: Path, rank: int = 0) -> None:
        self.storage = SimpleNamespace(storage_filesystem=LocalFileSystem(),
                                       experiment_fs_path=str(root))
        self.rank = rank

    def get_storage(self) -> Any:
        return self.storage

    def get_world_rank(self) -> int:
        return self.rank


def _checkpoint(root: Path, name: str, step: int, run_dirs: list[Path], *,
                short: str | None = None) -> dict[str, int]:
    """A checkpoint as Ray's storage holds it after every rank's upload (``short``: one file
    cut short, as a worker that died mid-upload leaves it)."""
    files = {"meta.json": 20, "rank-0.pt": 8, "rank-1.pt": 8, "model/__0_0.distcp": 64,
             "model/.metadata": 12}
    for rel, size in files.items():
        path = root / name / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes([step]) * (size // 2 if rel == short else size))
    (root / name / ray_checkpoint.RUN_FILE).write_text(json.dumps(
        {"step": step, "run_dirs": [str(d) for d in run_dirs], "files": files}))
    return files


@pytest.fixture
def ray_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """This process as Ray's rank 1, with nothing saved yet; Ray registered nothing."""
    root = tmp_path / "storage" / "job"
    root.mkdir(parents=True)
    run_dirs = [tmp_path / f"node-{rank}" / "run" for rank in range(2)]
    worker: dict[str, Any] = {"root": root, "registered": None, "run_dirs": run_dirs}
    monkeypatch.setattr(ray_train, "train_context", lambda: _Context(root, rank=1))
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: worker["registered"])
    monkeypatch.setattr(ray_checkpoint, "_saved", set())
    return worker


def _records(root: Path, run_dir: Path, names: list[str]) -> None:
    (root / ray_checkpoint.POINTER).write_text(json.dumps({"runs": {str(run_dir): names}}))


def test_a_worker_resumes_from_the_newest_complete_save_not_only_what_ray_registered(
        ray_worker: dict[str, Any]) -> None:
    root, run_dirs = ray_worker["root"], ray_worker["run_dirs"]
    for step in (2, 4):
        files = _checkpoint(root, f"step-{step}", step, run_dirs)
    _checkpoint(root, "step-6", 6, run_dirs, short="model/__0_0.distcp")  # cut short: ray#41700
    _records(root, run_dirs[0], ["step-2", "step-4", "step-6"])
    # A worker killed right after step 4's save: Ray's controller had registered step 2 only.
    ray_worker["registered"] = SimpleNamespace(path=str(root / "step-2"))
    mine = run_dirs[1]  # this worker's disk was lost: nothing there
    got = ray_checkpoint.latest_checkpoint(mine)
    assert got == mine / "step-4"
    assert {p.relative_to(got).as_posix(): p.stat().st_size for p in got.rglob("*")
            if p.is_file()} == files  # Ray's copy, downloaded (its accumix-ray.json left out)
    assert (got / "rank-1.pt").read_bytes() == bytes([4]) * 8
    # Again (load_state resolves it a second time): the copy in run_dir, no second download.
    mtime = (got / "meta.json").stat().st_mtime_ns
    assert ray_checkpoint.latest_checkpoint(mine) == got
    assert (got / "meta.json").stat().st_mtime_ns == mtime
    assert not list(mine.glob(".step-*"))


def test_a_registered_checkpoint_newer_than_the_records_wins_and_replaces_a_partial_copy(
        ray_worker: dict[str, Any]) -> None:
    root, run_dirs = ray_worker["root"], ray_worker["run_dirs"]
    _checkpoint(root, "step-2", 2, run_dirs)
    _checkpoint(root, "step-4-1", 4, run_dirs)  # an ASYNC save: registered, not recorded
    _records(root, run_dirs[0], ["step-2"])
    ray_worker["registered"] = SimpleNamespace(path=str(root / "step-4-1"))
    mine = run_dirs[1]
    (mine / "step-4").mkdir(parents=True)  # this node's own part only
    (mine / "step-4" / "rank-1.pt").write_bytes(b"x" * 8)
    got = ray_checkpoint.latest_checkpoint(mine)
    assert got == mine / "step-4" and (got / "model" / "__0_0.distcp").is_file()
    assert (got / "rank-1.pt").read_bytes() == bytes([4]) * 8  # Ray's, in its place
    assert sorted(p.name for p in mine.iterdir()) == ["step-4"]  # nothing left beside it


def test_another_run_directory_or_a_worker_that_saved_follows_its_own_latest(
        ray_worker: dict[str, Any], tmp_path: Path) -> None:
    root, run_dirs = ray_worker["root"], ray_worker["run_dirs"]
    _checkpoint(root, "step-4", 4, run_dirs)
    _records(root, run_dirs[0], ["step-4"])
    # A pre-trained run loaded at the start: Ray's checkpoint is not of it.
    other = tmp_path / "pretrained"
    (other / "step-9").mkdir(parents=True)
    (other / "latest").write_text("step-9\n")
    assert ray_checkpoint.latest_checkpoint(other) == other / "step-9"
    # Nothing of this run at Ray and nothing local: a fresh start.
    assert ray_checkpoint.latest_checkpoint(tmp_path / "fresh") is None
    # Once this worker saved into its run directory, its own latest is current.
    mine = run_dirs[1]
    ray_checkpoint._saved.add(str(mine.absolute()))
    assert ray_checkpoint.latest_checkpoint(mine) is None and not mine.exists()


def test_records_keep_the_last_saves_of_each_run_and_a_repeated_name_gets_a_suffix(
        ray_worker: dict[str, Any]) -> None:
    root = ray_worker["root"]
    for name in ("step-1", "step-2", "step-3", "step-4"):
        ray_checkpoint._record("/a", name)
    ray_checkpoint._record("/b", "step-1-1")
    runs = json.loads((root / ray_checkpoint.POINTER).read_text())["runs"]
    assert runs == {"/a": ["step-2", "step-3", "step-4"], "/b": ["step-1-1"]}
    (root / "step-4").mkdir()
    (root / "step-4-1").mkdir()
    assert ray_checkpoint._free_name("step-4") == "step-4-2"
    assert ray_checkpoint._free_name("step-5") == "step-5"


def test_the_launch_environment_is_ray_s_context(monkeypatch: pytest.MonkeyPatch) -> None:
    context = SimpleNamespace(get_world_size=lambda: 4, get_world_rank=lambda: 3,
                              get_local_rank=lambda: 1, get_local_world_size=lambda: 2,
                              get_node_rank=lambda: 1)
    monkeypatch.setattr(ray_train, "train_context", lambda: context)
    # Ray sets torchrun's variables too; its context says which node (outside a placement
    # group: nodes of equal size).
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    launch = detect_launch_env()
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank,
            launch.local_world_size, launch.node_rank, launch.num_nodes) == (
        "ray", 3, 4, 1, 2, 1, 2)
    assert detect_launch_env({"RANK": "3", "WORLD_SIZE": "4"}).launcher == "torchrun"
    assert ray_checkpoint.upload_mode("ASYNC") == "async"
    with pytest.raises(ray_checkpoint.ConfigError, match="checkpoint_upload_mode='later'"):
        ray_checkpoint.upload_mode("later")
