"""Tracker loggers in one process: bad input is one line; off rank 0 they do nothing and never
fail; the plain loop (open / log a row / close) without the Trainer; the JAX backend's run."""

from __future__ import annotations

import csv
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import accumix as ax
from accumix.cli.main import main
from accumix.trainer.loggers import resolve_loggers
from accumix.trainer.trackers import base
from accumix.trainer.trackers.mlflow_logger import MLflowLogger
from accumix.trainer.trackers.wandb_logger import WandbLogger


def _one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_an_unknown_logger_word_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ax.ConfigError) as exc:
        resolve_loggers(["csv", "mlfow"])
    assert _one_line(exc) == ("unknown logger 'mlfow'; use csv, jsonl, tensorboard, mlflow, "
                              "wandb, clearml or a MetricLogger")
    assert main(["train", "loggers=[csv,mlfow]", "--print-config"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err]
    assert "unknown logger 'mlfow'" in err


@pytest.mark.parametrize("word", ["mlflow", "wandb", "clearml"])
def test_a_missing_library_names_the_pip_command(word: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(base.importlib.util, "find_spec",
                        lambda name, *a: None if name == word else real(name, *a))
    with pytest.raises(ax.ConfigError) as exc:
        ax.Trainer(steps=_NoSteps(), max_steps=1, run_dir="unused", loggers=["csv", word])
    assert _one_line(exc) == (f"the {word} logger needs the {word} package; pip install "
                              f"'accumix[{word}]' or drop {word!r} from loggers")


class _NoSteps:
    """The least a Trainer needs to be built (it never trains here)."""

    accelerator = None
    optimizer_steps = 0


def test_an_unwritable_tracking_location_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ax.ConfigError) as exc:
        MLflowLogger(tracking_uri=f"sqlite:///{blocker}/sub/mlflow.db").open(
            tmp_path / "run", resume_step=0)
    message = _one_line(exc)
    assert message.startswith(f"mlflow cannot use the tracking location 'sqlite:///{blocker}/")
    assert message.endswith("set MLFLOW_TRACKING_URI or tracking_uri= to a writable place or a "
                            "reachable server")
    with pytest.raises(ax.ConfigError) as exc:
        WandbLogger().open(blocker / "run", resume_step=0)
    assert _one_line(exc).startswith(f"the wandb logger cannot write to run_dir "
                                     f"'{blocker / 'run'}'")


def test_off_rank_0_a_tracker_does_nothing_and_never_fails(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for logger in (MLflowLogger(log_model=True), WandbLogger()):
        logger.open(tmp_path, resume_step=0)
        logger.log_params({"k": 1}, tags={"job": "x"})
        logger.log({"step": 1, "loss": 1.0})
        logger.close()
        assert logger.run_id is None
    assert list(tmp_path.iterdir()) == []  # no run, no store, no trackers.json


def test_the_rank_comes_from_a_process_group_started_without_launcher_variables(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain loop that ran ``init_process_group(rank=1, ...)`` (mp.spawn, no RANK): rank 1
    must not open a second run."""
    import torch.distributed as dist

    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda *a: 1)
    assert base.process_rank() == 1
    logger = MLflowLogger()
    logger.open(tmp_path, resume_step=0)
    logger.log({"step": 1, "loss": 1.0})
    logger.close()
    assert (logger.run_id, sorted(p.name for p in tmp_path.iterdir())) == (None, [])


def test_the_rank_never_starts_jax_in_a_job_that_only_imported_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Asking ``jax.process_count()`` starts JAX's backends (most of a GPU's memory, and a later
    ``jax.distributed.initialize`` fails): without jax.distributed, JAX is not asked."""
    jax = pytest.importorskip("jax")
    asked: list[str] = []
    monkeypatch.setattr(jax, "process_count", lambda: asked.append("count") or 2)
    monkeypatch.setattr(jax, "process_index", lambda: asked.append("index") or 1)
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert not jax.distributed.is_initialized()
    assert (base.process_rank(), asked) == (0, [])


def test_the_plain_loop_logs_through_wandb_offline(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("RANK", "0")
    logger = WandbLogger(run_name="plain")
    logger.open(tmp_path, resume_step=0)
    logger.log_params({"lr": 0.1, "model": {"width": 8}}, tags={"job": "plain"})
    for step in (1, 2, 3):
        logger.log({"step": step, "loss": 1.0 / step, "skipped": 0, "note": None})
    logger.log({"step": 3, "loss": 9.0, "skipped": 1})  # an fp16 skip repeats step 3: dropped
    logger.close()
    run_id = json.loads((tmp_path / "trackers.json").read_text())["wandb"]["run_id"]
    (folder,) = (tmp_path / "wandb").glob(f"offline-run-*-{run_id}")
    out = subprocess.run([str(Path(sys.executable).parent / "wandb"), "leet", "inspect",
                          "--json", str(folder)], capture_output=True, text=True, check=True,
                         timeout=120).stdout
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    assert [(h["_step"], h["loss"]) for h in history] == [(1, 1.0), (2, 0.5), (3, 1 / 3)]
    config: dict = {}
    for r in records:
        if r["type"] in ("run", "config"):
            config.update((r.get("run", r).get("config") or {}).get("update", {}))
    assert config["lr"] == 0.1 and config["model.width"] == 8


def _wandb_records(folder: Path) -> list[dict]:
    """An offline W&B run's records, read with W&B's own reader (``wandb leet inspect``)."""
    out = subprocess.run([str(Path(sys.executable).parent / "wandb"), "leet", "inspect",
                          "--json", str(folder)], capture_output=True, text=True, check=True,
                         timeout=120).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_a_failed_fit_ends_every_tracker_run_as_failed(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       empty_mlflow_store: Path) -> None:
    """Each store is read back with its own reader: MLflow's client, W&B's offline run file,
    ClearML's offline session (``task.json``; its status was never set)."""
    import torch
    from mlflow.tracking import MlflowClient
    from torch.utils.data import DataLoader

    from tests import workloads as w

    for name in ("MLFLOW_TRACKING_URI", "WANDB_MODE", "CLEARML_API_HOST", "CLEARML_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CLEARML_OFFLINE_MODE", "1")
    shutil.copy(empty_mlflow_store, tmp_path / "mlflow.db")
    calls = []

    def failing(model: torch.nn.Module, batch: object) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return w.mean_loss(model, batch)

    data = w.regression_data(16)
    model = w.make_model()
    trainer = ax.Trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         train_loader=DataLoader(data, batch_size=4),
                         accelerator=ax.Accelerator(precision="fp32"), step_fn=failing,
                         max_steps=4, run_dir=tmp_path, loggers=["mlflow", "wandb", "clearml"],
                         progress_bar=False, system_metrics_every=None)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit()
    ids = json.loads((tmp_path / "trackers.json").read_text())
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = ids["mlflow"]["run_id"]
    assert client.get_run(run_id).info.status == "FAILED"  # was FINISHED
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1, 2]
    (folder,) = (tmp_path / "wandb").glob(f"offline-run-*-{ids['wandb']['run_id']}")
    records = _wandb_records(folder)
    assert [r["exit"]["exit_code"] for r in records if r["type"] == "exit"] == [1]
    assert [r["history"]["item"]["_step"] for r in records if r["type"] == "history"] == [1, 2]
    (session,) = ids["clearml"]["offline_sessions"]
    task = json.loads((tmp_path / "clearml" / "offline" / session / "task.json").read_text())
    assert (task["status"], task["status_reason"]) == ("failed", "RuntimeError: boom")


def test_mlflow_takes_any_column_name_numpy_numbers_and_long_params(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, empty_mlflow_store: Path) -> None:
    """MLflow refuses ``[``/``(`` in names and keys over 250 characters by raising, which
    stopped the fit at the first such row; values over 6000 characters it cuts, which must not
    read as a changed param on resume."""
    import numpy as np
    import torch
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("RANK", "0")
    long_key, long_value = "k" * 300, "v" * 7000
    shutil.copy(empty_mlflow_store, tmp_path / "mlflow.db")
    for attempt in (0, 1):  # the second: a resume of the same run with the same params
        logger = MLflowLogger()
        logger.open(tmp_path, resume_step=attempt)
        logger.log_params({"lr[0]": 0.1, long_key: 1, "text": long_value,
                           "model": {"dims": [8, 16], "none": None}})
        logger.log({"step": 1 + attempt, "loss": np.float32(0.5), "val_loss(ema)": 2.0,
                    "acc": torch.tensor(0.25), "nan": float("nan"), "skipped": 0})
        logger.close()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    history = {key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
               for key in ("loss", "val_loss_ema_", "acc")}
    assert history == {"loss": [(1, 0.5), (2, 0.5)], "val_loss_ema_": [(1, 2.0), (2, 2.0)],
                       "acc": [(1, 0.25), (2, 0.25)]}
    assert [m.step for m in client.get_metric_history(run.info.run_id, "nan")] == [1, 2]
    params = run.data.params
    assert (params["lr_0_"], params["k" * 250], len(params["text"]), params["model.dims"],
            params["model.none"]) == ("0.1", "1", 6000, "[8, 16]", "None")


def test_the_jax_backend_logs_one_mlflow_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             empty_mlflow_store: Path) -> None:
    pytest.importorskip("jax")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copy(empty_mlflow_store, run_dir / "mlflow.db")
    assert main(["train", "backend=jax", "nproc=1", "max_steps=3", "eval_every=null",
                 "checkpoint_every=null", "model.n_layer=1", "model.n_embd=32", "model.n_head=2",
                 "model.block_size=32", "data.max_files=8", "data.max_val_bytes=500",
                 "sample.max_new_tokens=0", "progress_bar=false", "plot=false",
                 "global_batch_size=8", "micro_batch_size=4", "precision=fp32",
                 "loggers=[csv,mlflow]", "system_metrics_every=1",
                 f"output_dir={run_dir}"]) == 0
    with (run_dir / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss"))
    assert history == [(int(r["step"]), float(r["loss"])) for r in rows]
    assert len(history) == 3
    params = run.data.params
    assert (params["backend"], params["world_size"], params["grad_accum_steps"],
            params["global_batch_size"]) == ("jax", "1", "2", "8")
    assert "jax_version" in params
    system = client.get_metric_history(run.info.run_id, "system/rank0/rss_mb")
    assert [m.step for m in system] == [3]  # the one metrics read of this short run
    assert float(rows[-1]["system/rank0/rss_mb"]) == system[0].value


def test_system_metrics_ride_in_the_steps_one_gather(tmp_path: Path) -> None:
    import torch
    from torch.utils.data import DataLoader

    from tests import workloads as w

    def run(every: int | None) -> tuple[int, list[dict[str, str]]]:
        data = w.regression_data(16)
        model = w.make_model(data.tensors[0].shape[-1])
        acc = ax.Accelerator(precision="fp32", grad_accum_steps=2)
        gathers = []
        real_gather = acc.gather
        acc.gather = lambda t: gathers.append(t.numel()) or real_gather(t)  # type: ignore
        run_dir = tmp_path / f"every-{every}"
        ax.Trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                   train_loader=DataLoader(data, batch_size=2), accelerator=acc,
                   step_fn=w.mean_loss, max_steps=4, run_dir=run_dir, loggers=["csv"],
                   progress_bar=False, system_metrics_every=every).fit()
        with (run_dir / "metrics.csv").open() as f:
            return len(gathers), list(csv.DictReader(f))

    calls_without, rows_without = run(None)
    calls_with, rows = run(2)
    assert calls_with == calls_without == 4  # one gather per optimizer step, either way
    assert [r["loss"] for r in rows] == [r["loss"] for r in rows_without]
    sampled = [r["step"] for r in rows if r["system/rank0/rss_mb"]]
    assert sampled == ["2", "4"]
    assert all(float(rows[i]["system/rank0/rss_mb"]) > 0 for i in (1, 3))
    assert "system/rank0/device_mem_mb" not in rows[0]  # a CPU: no device memory column
