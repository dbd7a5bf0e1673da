"""Issue 45, case 6: a tracking URI's password is never printed nor stored in clear: the CLI's
error line, warnings, ``trackers.json`` and the tracker's params show it masked."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from accumix.cli.main import main

SECRET = "S3cretPw-4c1d"
URI = f"postgresql://alice:{SECRET}@127.0.0.1:9/mlflow"
MASKED = "postgresql://alice:***@127.0.0.1:9/mlflow"


def test_redact_masks_passwords_and_credential_parameters() -> None:
    from accumix.common.redact import redact

    assert redact(f"error: {URI!r} failed") == f"error: {MASKED!r} failed"
    assert redact("mysql+pymysql://u:p@ss:w@db:3306/x?ssl=1") == "mysql+pymysql://u:***@db:3306/x?ssl=1"
    assert redact("https://host/api?user=a&token=abc123&x=1") == "https://host/api?user=a&token=***&x=1"
    # What must stay: no password, an e-mail, a scheme with a port, a plain path.
    for text in ("http://alice@host/x", "sqlite:///tmp/a:b/mlflow.db", "mail a@b.c now",
                 "http://host:5000/x", "file:///runs/x"):
        assert redact(text) == text


def test_an_unreachable_tracking_location_is_one_line_without_the_password(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Before: ``accumix train: error: mlflow cannot use the tracking location
    'postgresql://alice:S3cretPw-4c1d@...'``."""
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", URI)
    monkeypatch.setenv("ACCUMIX_OVERSUBSCRIBE", "1")  # nproc=2 on a machine of one core too
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    # nproc=2: the launcher checks every logger before starting any rank.
    assert main(["train", "nproc=2", "loggers=mlflow", f"output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and SECRET not in err
    assert f"mlflow cannot use the tracking location '{MASKED}'" in err


def test_trackers_json_params_and_warnings_hold_the_uri_masked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, empty_mlflow_store: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """A reachable store named by a URI with a password (the client is pointed at a SQLite
    copy underneath: what it stores and prints is what the test reads). Before: the URI in
    clear in trackers.json, in the run's params and in the warning."""
    from mlflow.tracking import MlflowClient

    from accumix.trainer.trackers.mlflow_logger import MLflowLogger

    store = tmp_path / "store.db"
    shutil.copy(empty_mlflow_store, store)
    real_init = MlflowClient.__init__

    def init(self: MlflowClient, tracking_uri: str | None = None, **kwargs: object) -> None:
        real_init(self, tracking_uri=f"sqlite:///{store}")

    monkeypatch.setattr(MlflowClient, "__init__", init)
    monkeypatch.setenv("RANK", "0")
    run_dir = tmp_path / "run"
    logger = MLflowLogger(tracking_uri=URI)
    logger.open(run_dir, resume_step=0)
    logger.log_params({"tracking": {"uri": URI}, "lr": 0.1}, tags={"db": URI})
    logger.close()
    saved = (run_dir / "trackers.json").read_text()
    assert SECRET not in saved
    assert json.loads(saved)["mlflow"]["tracking_uri"] == MASKED
    run = MlflowClient().get_run(logger.run_id)
    assert (run.data.params["tracking.uri"], run.data.tags["db"]) == (MASKED, MASKED)
    # The same location resumes the same run (masked on both sides); another one warns, masked.
    logger = MLflowLogger(tracking_uri=URI)
    logger.open(run_dir, resume_step=0)
    assert logger.run_id == run.info.run_id
    logger.close()
    other = URI.replace("alice", "bob")
    with caplog.at_level(logging.WARNING, logger="accumix"):
        logger = MLflowLogger(tracking_uri=other)
        logger.open(run_dir, resume_step=0)
        logger.close()
    (warning,) = [r.getMessage() for r in caplog.records if "starting a new run" in r.getMessage()]
    assert SECRET not in warning and MASKED in warning and MASKED.replace("alice", "bob") in warning
