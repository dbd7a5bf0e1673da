"""Checkpoints on an object store, one process (issue 40): URLs told from paths, publishing
without renames (``memory://``, fsspec's in-process store), the Trainer and the recipe with a
URL run directory, and the S3 server stopped in the middle of a save (the session's moto)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import accumix as ax
from accumix.checkpoint import latest_checkpoint
from accumix.common import run_dir as layout
from accumix.common.locations import RemotePath, location
from accumix.recipes.train_config import TrainConfig
from accumix.trainer import Trainer, checkpointing
from tests import workloads as w
from tests.scripts.resumable_train import build, params, train


def _run(run_dir: str | None = None, load: str | None = None, **kwargs: Any
         ) -> tuple[dict[str, np.ndarray], int]:
    acc = ax.Accelerator(strategy="single", precision="fp32", grad_accum_steps=3, seed=0)
    objects = build(acc, micro_batch=4)
    if load is not None:
        acc.load_state(load)
    train(acc, objects, epochs=2, run_dir=run_dir, **kwargs)
    acc.end()
    return {k: v.numpy() for k, v in params(acc, objects[0]).items()}, acc.optimizer_steps


def _equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_urls_told_from_paths_and_refused_in_one_line(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert location("file:///tmp/x") == Path("/tmp/x")
    assert isinstance(location("memory://x/y"), RemotePath)
    refusals = {
        # pathlib joins '//' into '/': before issue 40 this wrote ./s3:/bucket/job
        "collapsed": (Path("s3://bucket/job"), "with a slash lost"),
        "no library": ("gs://bucket/job", "needs the fsspec library for gs://"),
        "unknown": ("nosuch://bucket/job", "nosuch"),
    }
    acc = ax.Accelerator(strategy="single", precision="fp32", grad_accum_steps=1)
    for name, (run_dir, words) in refusals.items():
        with pytest.raises(ax.ConfigError) as refused:
            acc.save_state(run_dir)
        assert words in str(refused.value) and "\n" not in str(refused.value), name
    assert list(tmp_path.iterdir()) == []  # nothing written anywhere


def test_object_store_publishes_whole_steps_and_resumes_exactly() -> None:
    url = f"memory://accumix-{uuid.uuid4().hex}/job"
    reference = _run()
    _run(url, stop_at=3, save_at={1, 2, 3})
    store = location(url)
    assert isinstance(store, RemotePath)
    assert layout.step_dirs(store) == ["step-2", "step-3"]  # keep_last=2
    assert (store / "latest").read_text() == "step-3\n"
    # A save that stopped before its meta.json: not a checkpoint, and the next save removes it.
    (store / "step-4" / "rank-0.pt").write_bytes(b"partial")
    assert layout.step_dirs(store) == ["step-2", "step-3"]
    assert latest_checkpoint(url) == store / "step-3"
    with pytest.raises(ax.CheckpointError, match="neither latest nor meta.json"):
        layout.resolve(store / "step-4")
    resumed = _run(url, load=url, save_at={4})
    assert resumed[1] == reference[1] and _equal(resumed[0], reference[0])
    assert not (store / "step-4" / "rank-0.pt").read_bytes() == b"partial"
    assert layout.step_dirs(store) == ["step-3", "step-4"]
    # The same step saved again: it stops being published first (latest goes back to step-3).
    acc = ax.Accelerator(strategy="single", precision="fp32", grad_accum_steps=3, seed=0)
    build(acc, micro_batch=4)
    acc.load_state(url)
    seen: list[str] = []
    acc.save_state(url, before_publish=lambda tmp: seen.append(
        (store / "latest").read_text().strip()))
    assert seen == ["step-3"] and (store / "latest").read_text() == "step-4\n"


def test_trainer_and_recipe_with_a_url_run_dir(tmp_path: Path) -> None:
    url = f"memory://accumix-{uuid.uuid4().hex}/job"
    data = w.regression_data(24)

    def fit(max_steps: int) -> Any:
        model = w.make_model(data.tensors[0].shape[-1])
        acc = ax.Accelerator(precision="fp32", grad_accum_steps=2)
        trainer = Trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          train_loader=DataLoader(data, batch_size=3), accelerator=acc,
                          step_fn=w.mean_loss, progress_bar=False, max_steps=max_steps,
                          checkpoint_every=2, checkpoint_background=True, run_dir=url,
                          local_dir=tmp_path / "local")
        return trainer.fit()

    assert fit(3).resumed_from is None
    store = location(url)
    assert layout.step_dirs(store) == ["step-2", "step-3"]  # periodic (background), last
    assert (tmp_path / "local" / "metrics.csv").is_file()  # metrics stay local
    assert not any("metrics" in p.name for p in store.iterdir())
    again = fit(5)
    assert again.resumed_from == store and again.step == 5
    with pytest.raises(ax.ConfigError, match="local_dir"):
        checkpointing.run_dirs(tmp_path / "x", tmp_path / "y")  # local_dir without a URL
    config = TrainConfig(name="gpt", output_dir="s3://bucket/job", checkpoint_background=True)
    assert config.trainer_dirs() == {"run_dir": "s3://bucket/job", "local_dir": Path("runs/gpt"),
                                     "checkpoint_background": True}
    assert config.run_dir == Path("runs/gpt")


def test_s3_server_stopped_mid_save_leaves_latest(s3: str, s3_server: dict[str, str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A second moto server on the same in-process store, stopped while the model is being
    written: a clear error, and ``latest`` still on the previous step (read through the
    session's server)."""
    import s3fs
    from moto.server import ThreadedMotoServer
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    doomed = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    doomed.start()
    host, port = doomed.get_host_and_port()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    s3fs.S3FileSystem.clear_instance_cache()
    url = f"{s3}/job"
    acc = ax.Accelerator(strategy="single", precision="fp32", grad_accum_steps=3, seed=0)
    objects = build(acc, micro_batch=4)
    train(acc, objects, epochs=2, save_at={1}, run_dir=url, stop_at=1)
    write = FileSystemWriter.write_data

    def stop_then_write(self: Any, plan: Any, planner: Any) -> Any:
        doomed.stop()  # the server goes away as the model's bytes start to go out
        return write(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", stop_then_write)
    with pytest.raises(ax.CheckpointError) as failed:
        train(acc, objects, epochs=2, save_at={2}, run_dir=url, stop_at=2)
    message = str(failed.value)
    assert "\n" not in message and "step-2/model" in message and "not published" in message
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server["AWS_ENDPOINT_URL"])
    s3fs.S3FileSystem.clear_instance_cache()
    assert latest_checkpoint(url) == location(url) / "step-1"
    assert layout.step_dirs(location(url)) == ["step-1"]
