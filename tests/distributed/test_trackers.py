"""Experiment trackers end to end: a 2-rank ``accumix train loggers=[csv,mlflow,wandb,clearml]``
job, cut short after a step it logged but never checkpointed, then resumed; every tracker is
read back through its own library (MLflow's client, ``wandb leet inspect``, ClearML's offline
session files), compared with metrics.csv and found ended as finished. No process may touch the
network: every HTTP(S) client is pointed at a loopback listener that counts connections, and
it must count none.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

ACCUMIX = [sys.executable, "-m", "accumix.cli.main"]
JOB = ["nproc=2", "global_batch_size=8", "micro_batch_size=2", "precision=fp32",
       "strategy=ddp", "eval_every=null", "checkpoint_every=2", "model.n_layer=1",
       "model.n_embd=32", "model.n_head=2", "model.block_size=32", "data.max_files=8",
       "data.max_val_bytes=500", "sample.max_new_tokens=0", "progress_bar=false", "plot=false",
       "loggers=[csv,mlflow,wandb,clearml]", "system_metrics_every=1", "log_model=true",
       "name=tracked"]


@pytest.fixture
def listener() -> Iterator[list[str]]:
    """A loopback TCP server standing in for every network destination; yields its port, then
    the first bytes of each connection made to it (the test wants none)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    server.settimeout(0.2)
    peers: list[str] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            conn.settimeout(2)
            try:
                peers.append(conn.recv(120).decode(errors="replace"))  # the request line
            except OSError as exc:
                peers.append(repr(exc))
            conn.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    peers.insert(0, str(server.getsockname()[1]))  # the port, first
    yield peers
    stop.set()
    thread.join()
    server.close()


def _environment(home: Path, port: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MLFLOW_TRACKING_URI", "WANDB_MODE",
                        "WANDB_API_KEY", "CLEARML_API_HOST", "CLEARML_CONFIG_FILE",
                        "CLEARML_CACHE_DIR", "NO_PROXY", "no_proxy")}
    trap = f"http://127.0.0.1:{port}"
    env.update(HOME=str(home), OMP_NUM_THREADS="1", HTTP_PROXY=trap, HTTPS_PROXY=trap,
               http_proxy=trap, https_proxy=trap, WANDB_BASE_URL=trap)
    return env


def _train(run_dir: Path, env: dict[str, str], *extra: str) -> None:
    done = subprocess.run([*ACCUMIX, "train", *JOB, f"output_dir={run_dir}", *extra], env=env,
                          cwd=run_dir.parent, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def _csv_losses(run_dir: Path) -> dict[int, float]:
    with (run_dir / "metrics.csv").open() as f:
        return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(f)}


def _wandb_attempts(run_dir: Path) -> list[dict]:
    """Each offline attempt's records, read with W&B's own reader (``wandb leet inspect``)."""
    wandb_cli = Path(sys.executable).parent / "wandb"
    attempts = []
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        out = subprocess.run([str(wandb_cli), "leet", "inspect", "--json", str(folder)],
                             capture_output=True, text=True, timeout=120, check=True).stdout
        records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        run = next(r["run"] for r in records if r["type"] == "run")
        history = [r["history"]["item"] for r in records if r["type"] == "history"]
        config = {}
        for r in records:
            if r["type"] in ("run", "config"):
                config.update((r.get("run", r).get("config") or {}).get("update", {}))
        exits = [r["exit"]["exit_code"] for r in records if r["type"] == "exit"]
        attempts.append({"run_id": run["run_id"], "history": history, "config": config,
                         "exits": exits})
    return attempts


def test_one_tracker_run_per_job_resumed_without_duplicate_steps(
        tmp_path: Path, listener: list[str]) -> None:
    from mlflow.tracking import MlflowClient

    home = tmp_path / "home"
    home.mkdir()
    env = _environment(home, listener[0])
    run_dir = tmp_path / "run"
    _train(run_dir, env, "max_steps=3")
    first_ids = json.loads((run_dir / "trackers.json").read_text())
    # A crash after step 3 was logged and before its checkpoint: the job resumes at step 2 and
    # logs step 3 again.
    shutil.rmtree(run_dir / "step-3")
    (run_dir / "latest").write_text("step-2")
    _train(run_dir, env, "max_steps=4")
    ids = json.loads((run_dir / "trackers.json").read_text())
    losses = _csv_losses(run_dir)
    assert sorted(losses) == [1, 2, 3, 4]

    # MLflow: one run, the same after the resume; one point per optimizer step, = metrics.csv.
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments)
    assert [r.info.run_id for r in runs] == [first_ids["mlflow"]["run_id"]]
    assert ids["mlflow"]["run_id"] == first_ids["mlflow"]["run_id"]
    assert runs[0].info.status == "FINISHED"
    run_id = runs[0].info.run_id
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss"))
    assert history == sorted(losses.items())
    params = runs[0].data.params
    assert {k: params[k] for k in ("grad_accum_steps", "micro_batch_size", "global_batch_size",
                                   "world_size", "precision", "backend", "strategy")} == {
        "grad_accum_steps": "2", "micro_batch_size": "2", "global_batch_size": "8",
        "world_size": "2", "precision": "fp32", "backend": "torch", "strategy": "ddp"}
    assert params["config.max_steps"] == "3"  # write-once: the first attempt's value
    assert runs[0].data.tags["job"] == "tracked"
    for rank in (0, 1):
        for name in ("cpu_percent", "rss_mb", "step_time_s"):
            points = client.get_metric_history(run_id, f"system/rank{rank}/{name}")
            assert sorted(m.step for m in points) == [1, 2, 3, 4], (rank, name)
    assert "model.safetensors" in [a.path for a in client.list_artifacts(run_id)]

    # W&B offline: each attempt is an offline run with the job's one id; rows by step.
    attempts = _wandb_attempts(run_dir)
    assert [a["run_id"] for a in attempts] == [first_ids["wandb"]["run_id"]] * 2
    for attempt, steps in zip(attempts, ([1, 2, 3], [3, 4]), strict=True):
        assert [row["_step"] for row in attempt["history"]] == steps
        assert attempt["exits"] == [0]
        assert [row["loss"] for row in attempt["history"]] == [losses[s] for s in steps]
        assert {"system/rank0/rss_mb", "system/rank1/rss_mb"} <= set(attempt["history"][-1])
        config = attempt["config"]
        assert (config["world_size"], config["grad_accum_steps"], config["micro_batch_size"],
                config["global_batch_size"], config["precision"]) == (2, 2, 2, 8, "fp32")

    # ClearML offline: one task id for the job; each attempt's session holds its iterations.
    assert ids["clearml"]["run_id"] == first_ids["clearml"]["run_id"]
    sessions = ids["clearml"]["offline_sessions"]
    assert len(sessions) == 2 and sessions[0] == ids["clearml"]["run_id"]
    for session, steps in zip(sessions, ([1, 2, 3], [3, 4]), strict=True):
        folder = run_dir / "clearml" / "offline" / session
        events = json.loads((folder / "metrics.jsonl").read_text())
        loss = sorted((e["iter"], e["value"]) for e in events if e["metric"] == "loss")
        assert loss == [(s, losses[s]) for s in steps]
        assert {e["metric"] for e in events} >= {"system/rank0", "system/rank1"}
        task = json.loads((folder / "task.json").read_text())
        assert task["status"] == "completed"
        hyper = task["hyperparams"]["accumix"]
        assert {k: hyper[k]["value"] for k in ("world_size", "grad_accum_steps",
                                               "global_batch_size", "precision")} == {
            "world_size": "2", "grad_accum_steps": "2", "global_batch_size": "8",
            "precision": "fp32"}

    # metrics.csv carries every rank's system metrics too.
    with (run_dir / "metrics.csv").open() as f:
        header = next(csv.reader(f))
    assert {"system/rank0/cpu_percent", "system/rank1/cpu_percent"} <= set(header)
    assert listener[1:] == [], "a tracker tried the network"
