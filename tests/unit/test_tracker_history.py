"""Tracker histories across kills, pre-emption, fresh starts and resumes (issue 29 items 3-8),
one process; each store is read back with its own reader (MLflow's client, ``wandb leet
inspect``)."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import accumix as ax
from accumix.trainer import Callback, GradientAccumulationScheduler, Trainer
from accumix.trainer.trackers.mlflow_logger import MLflowLogger
from tests.scripts.tracked_trainer import fit

SCRIPT = Path(__file__).parents[1] / "scripts" / "tracked_trainer.py"


@pytest.fixture(autouse=True)
def _local_trackers(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_MODE", "RANK"):
        monkeypatch.delenv(name, raising=False)


def _client(uri: str) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _runs(client: Any) -> list[Any]:
    return client.search_runs([e.experiment_id for e in client.search_experiments()],
                              order_by=["attributes.start_time ASC"])


def _history(client: Any, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def _csv_losses(run_dir: Path) -> dict[int, float]:
    with (run_dir / "metrics.csv").open() as f:
        return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(f)}


def _wandb_attempts(run_dir: Path) -> list[dict[str, Any]]:
    attempts = []
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        out = subprocess.run([str(Path(sys.executable).parent / "wandb"), "leet", "inspect",
                              "--json", str(folder)], capture_output=True, text=True,
                             check=True, timeout=120).stdout
        records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        attempts.append({
            "rows": {r["history"]["item"]["_step"]: r["history"]["item"]["loss"]
                     for r in records if r["type"] == "history"},
            "exits": [r["exit"]["exit_code"] for r in records if r["type"] == "exit"]})
    return attempts


def test_wandb_gets_the_rows_a_killed_attempt_lost(tmp_path: Path) -> None:
    """wandb-core writes an offline run's rows when it finishes: a SIGKILLed job left its
    attempt empty, and the resumed attempt sent only the steps after the checkpoint."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    killed = subprocess.run([sys.executable, str(SCRIPT), str(run_dir), "--loggers",
                             "csv,wandb", "--max-steps", "8", "--kill-at", "6"], env=env,
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert (run_dir / "latest").read_text().strip() == "step-4"
    fit(run_dir, ["csv", "wandb"], max_steps=8)
    losses = _csv_losses(run_dir)
    assert sorted(losses) == list(range(1, 9))
    attempts = _wandb_attempts(run_dir)
    assert len(attempts) == 2 and attempts[-1]["exits"] == [0]
    held: dict[int, float] = {}
    for attempt in attempts:  # synced in order: a step already held keeps its first value
        held = {**attempt["rows"], **held}
    assert held == losses  # was steps 5..8 only
    ledger = json.loads((run_dir / "trackers.json").read_text())["wandb"]
    assert (ledger["attempt"], ledger["logged_through"]) == (2, 8)


def test_a_fresh_start_opens_new_tracker_runs(tmp_path: Path,
                                              empty_mlflow_store: Path) -> None:
    shutil.copy(empty_mlflow_store, tmp_path / "mlflow.db")
    fit(tmp_path, ["csv", "mlflow", "wandb"], max_steps=2, config={"lr": 0.05})
    first = json.loads((tmp_path / "trackers.json").read_text())
    fit(tmp_path, ["csv", "mlflow", "wandb"], max_steps=3, resume=False, config={"lr": 0.5})
    second = json.loads((tmp_path / "trackers.json").read_text())
    assert second["wandb"]["run_id"] != first["wandb"]["run_id"]  # W&B reused the id
    client = _client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    old, new = _runs(client)  # was one run: the old history deleted, the old config kept
    assert (old.info.run_id, new.info.run_id) == (first["mlflow"]["run_id"],
                                                 second["mlflow"]["run_id"])
    assert [s for s, _ in _history(client, old.info.run_id, "loss")] == [1, 2]
    assert [s for s, _ in _history(client, new.info.run_id, "loss")] == [1, 2, 3]
    assert (old.data.params["config.lr"], new.data.params["config.lr"]) == ("0.05", "0.5")


def test_mlflow_resume_keeps_every_key_and_records_changed_params(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, empty_mlflow_store: Path) -> None:
    """A 2-rank job resumed at step 2 on one process: ``system/rank1/*`` is not logged again
    and used to vanish from ``run.data.metrics`` and ``search_runs``; the params kept the
    first attempt's world and strategy."""
    monkeypatch.setenv("RANK", "0")
    shutil.copy(empty_mlflow_store, tmp_path / "mlflow.db")
    _two_attempts(tmp_path)
    client = _client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = _runs(client)
    assert run.data.metrics["system/rank1/rss_mb"] == 102.0  # step 2's, the newest left
    assert run.data.metrics["loss"] == 0.25
    found = client.search_runs([run.info.experiment_id],
                               "metrics.`system/rank1/rss_mb` > 0")
    assert [r.info.run_id for r in found] == [run.info.run_id]
    assert _history(client, run.info.run_id, "loss") == [(1, 1.0), (2, 0.5), (3, 1 / 3),
                                                         (4, 0.25)]
    params = run.data.params
    assert {k: params[k] for k in params if "world_size" in k or "strategy" in k} == {
        "world_size": "2", "strategy": "ddp", "attempt2.world_size": "1",
        "attempt2.strategy": "single"}


def _two_attempts(run_dir: Path) -> None:
    for attempt, (world, strategy) in enumerate([(2, "ddp"), (1, "single")]):
        logger = MLflowLogger()
        logger.open(run_dir, resume_step=2 * attempt)
        logger.log_params({"world_size": world, "strategy": strategy})
        for step in range(2 * attempt + 1, 5):
            row: dict[str, Any] = {"step": step, "loss": 1.0 / step}
            if world == 2:
                row["system/rank1/rss_mb"] = 100.0 + step
            logger.log(row)
        logger.close()


def test_mlflow_file_store_keeps_one_point_per_step(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow's ``file:`` store (opt-in in MLflow 3): the repeated steps of a resume had two
    points each."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    store = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    _two_attempts(tmp_path / "run")
    client = _client(store)
    (run,) = _runs(client)
    assert _history(client, run.info.run_id, "loss") == [(1, 1.0), (2, 0.5), (3, 1 / 3),
                                                         (4, 0.25)]
    assert [s for s, _ in _history(client, run.info.run_id, "system/rank1/rss_mb")] == [1, 2]


def test_a_custom_sqlite_store_keeps_artifacts_beside_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, empty_mlflow_store: Path) -> None:
    """They went to ``./mlruns`` of whatever directory the job ran in."""
    monkeypatch.setenv("RANK", "0")
    (tmp_path / "store").mkdir()
    shutil.copy(empty_mlflow_store, tmp_path / "store" / "custom.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'store' / 'custom.db'}")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    logger = MLflowLogger(log_model=True)
    logger.open(tmp_path / "run", resume_step=0)
    (tmp_path / "run" / "model.safetensors").write_bytes(b"weights")
    logger.close()
    uploaded = list((tmp_path / "store" / "mlflow-artifacts").rglob("model.safetensors"))
    assert [p.read_bytes() for p in uploaded] == [b"weights"]
    assert list((tmp_path / "cwd").iterdir()) == []


def test_params_state_the_accumulation_in_force(tmp_path: Path,
                                                empty_mlflow_store: Path) -> None:
    """A GradientAccumulationScheduler sets K when the first window starts: the params said
    the Accelerator's K=2 (global batch 8) while every step ran with K=4; a later change is a
    column of the row where it took effect."""
    shutil.copy(empty_mlflow_store, tmp_path / "mlflow.db")
    fit(tmp_path, ["csv", "mlflow"], max_steps=5, k=2,
        callbacks=(GradientAccumulationScheduler({0: 4, 3: 8}, by="step"),))
    client = _client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = _runs(client)
    params = run.data.params
    assert (params["grad_accum_steps"], params["global_batch_size"]) == ("4", "16")
    assert _history(client, run.info.run_id, "grad_accum_steps") == [(4, 8.0)]
    assert _history(client, run.info.run_id, "global_batch_size") == [(4, 32.0)]
    with (tmp_path / "metrics.csv").open() as f:
        column = [r["grad_accum_steps"] for r in csv.DictReader(f)]
    assert column == ["", "", "", "8", ""]


class _TermAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_validation_start(self, trainer: Trainer) -> None:
        if trainer.step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_preempted_fit_ends_its_mlflow_run_killed_and_the_resume_finishes_it(
        tmp_path: Path, empty_mlflow_store: Path) -> None:
    """The run stayed RUNNING (the process died of the signal)."""
    shutil.copy(empty_mlflow_store, tmp_path / "mlflow.db")
    with pytest.raises(ax.Preempted):
        fit(tmp_path, ["csv", "mlflow"], max_steps=6, eval_every=3, checkpoint_every=None,
            val_loader=_val_loader(), callbacks=(_TermAt(3),))
    client = _client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = _runs(client)
    assert run.info.status == "KILLED"
    fit(tmp_path, ["csv", "mlflow"], max_steps=6, checkpoint_every=None)
    (run,) = _runs(client)
    assert run.info.status == "FINISHED"
    assert [s for s, _ in _history(client, run.info.run_id, "loss")] == [1, 2, 3, 4, 5, 6]


def _val_loader() -> Any:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    return DataLoader(TensorDataset(torch.zeros(4, 6), torch.zeros(4, 1)), batch_size=4)
