"""Fixtures shared by the one-process tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def empty_mlflow_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An MLflow SQLite store as MLflow creates it: each creation runs every schema migration
    (seconds), so the tests copy this one where the logger looks (tests/distributed/
    test_trackers.py lets the logger create its own)."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-store") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path
