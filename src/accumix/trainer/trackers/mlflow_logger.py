"""MLflow: a SQLite store in the run directory unless ``MLFLOW_TRACKING_URI`` or ``tracking_uri``
points elsewhere (``pip install 'accumix[mlflow]'``).

Metrics are indexed by optimizer step. On a resume, the points after the checkpoint's step (the
steps the job is about to repeat) are deleted from the local SQLite store first, so every step
keeps one value; MLflow's API has no way to delete metric points, so on a tracking server the
repeated steps show both values (README, "Experiment trackers").
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from typing_extensions import override

from accumix.errors import ConfigError
from accumix.trainer.trackers.base import TrackerLogger, first_line

log = logging.getLogger("accumix")

_PARAMS_PER_CALL = 100  # MLflow's log_batch limit
_METRICS_PER_CALL = 1000
_KEY_LIMIT = 250  # MLflow's longest metric name or param key
_VALUE_LIMIT = 6000  # MLflow's longest param value
# The characters MLflow refuses in a metric name or param key (it raises, stopping the fit)
_REFUSED = re.compile(r"[^\w\-. :/]", re.ASCII)


def mlflow_key(key: str) -> str:
    """``key`` as MLflow takes it: each refused character (``lr[0]``, ``val_loss(ema)``) an
    underscore, cut to 250 characters."""
    return _REFUSED.sub("_", key)[:_KEY_LIMIT]


class MLflowLogger(TrackerLogger):
    """One MLflow run per job; metrics by optimizer step, config and derived facts as params.

    Args:
        tracking_uri: where runs go; default ``MLFLOW_TRACKING_URI``, else
            ``sqlite:///<run_dir>/mlflow.db`` (artifacts beside it in ``mlflow-artifacts/``).
        experiment: the experiment's name (default ``MLFLOW_EXPERIMENT_NAME``, else
            ``accumix``).
        log_model: upload the final ``model.safetensors`` at ``close``.
        run_name: the run's name (default: the run directory's name).

    Raises:
        ConfigError: mlflow is not installed.
    """

    word = "mlflow"
    module = "mlflow"

    def __init__(self, *, tracking_uri: str | None = None, experiment: str | None = None,
                 log_model: bool = False, run_name: str | None = None) -> None:
        super().__init__(log_model=log_model, run_name=run_name)
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self._client: Any = None

    def _uri(self) -> tuple[str, bool]:
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if uri:
            return uri, False
        assert self.run_dir is not None
        return f"sqlite:///{(self.run_dir / 'mlflow.db').resolve()}", True

    @override
    def _start(self, saved: dict[str, Any] | None, resume_step: int) -> dict[str, Any]:
        from mlflow.tracking import MlflowClient

        assert self.run_dir is not None
        uri, local = self._uri()
        if local:  # local means no network: MLflow 3's usage telemetry stays off unless asked
            os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        if saved and saved.get("tracking_uri") not in (None, uri):
            log.warning("mlflow: this run directory's run %s is in %s, not %s; starting a new "
                        "run there", saved["run_id"], saved["tracking_uri"], uri)
            saved = None
        try:
            self._client = client = MlflowClient(tracking_uri=uri)
            if saved:
                run_id = saved["run_id"]
                client.get_run(run_id)  # it must still exist
                client.update_run(run_id, status="RUNNING")
                self._forget_after(run_id, resume_step)
            else:
                name = self.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME", "accumix")
                experiment = client.get_experiment_by_name(name)
                if experiment is None:
                    artifacts = (self.run_dir / "mlflow-artifacts").resolve().as_uri() \
                        if local else None
                    experiment_id = client.create_experiment(name,
                                                             artifact_location=artifacts)
                else:
                    experiment_id = experiment.experiment_id
                run_id = client.create_run(experiment_id, run_name=self.run_name).info.run_id
        except Exception as exc:  # sqlalchemy, OSError, MlflowException: one line for the user
            raise ConfigError(f"mlflow cannot use the tracking location {uri!r} ({first_line(exc)})"
                              "; set MLFLOW_TRACKING_URI or tracking_uri= to a writable "
                              "place or a reachable server") from None
        return {"run_id": run_id, "tracking_uri": uri}

    def _forget_after(self, run_id: str, step: int) -> None:
        """Deletes the run's metric points after ``step`` from a SQL store (the steps a resumed
        job repeats). MLflow has no API for it; its own ORM models and session do it."""
        try:
            from mlflow.store.tracking.dbmodels.models import SqlLatestMetric, SqlMetric
            from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

            store = self._client._tracking_client.store
            if not isinstance(store, SqlAlchemyStore):
                return
            with store.ManagedSessionMaker() as session:
                for table in (SqlMetric, SqlLatestMetric):
                    session.query(table).filter(table.run_uuid == run_id,
                                                table.step > step).delete()
        except Exception as exc:  # an MLflow whose internals moved: keep the duplicates
            log.warning("mlflow: could not drop the points after step %d (%s); the repeated "
                        "steps will show two values", step, first_line(exc))

    @override
    def _params(self, params: dict[str, Any], tags: dict[str, str]) -> None:
        from mlflow.entities import Param, RunTag

        assert self.run_id is not None
        existing = self._client.get_run(self.run_id).data.params
        values = {mlflow_key(k): str(v)[:_VALUE_LIMIT] for k, v in params.items()}
        # MLflow params are write-once: a resumed job logs only what is new, and says what
        # it changed (say a larger max_steps) instead of failing.
        changed = sorted(k for k, v in values.items() if k in existing and existing[k] != v)
        if changed:
            log.warning("mlflow: params keep their first values; changed on resume: %s",
                        ", ".join(changed))
        items = [Param(k, v) for k, v in values.items() if k not in existing]
        for start in range(0, len(items), _PARAMS_PER_CALL):
            self._client.log_batch(self.run_id, params=items[start:start + _PARAMS_PER_CALL])
        if tags:
            self._client.log_batch(self.run_id, tags=[RunTag(mlflow_key(k), str(v))
                                                      for k, v in tags.items()])

    @override
    def _metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(mlflow_key(k), v, now, step) for k, v in metrics.items()]
        for start in range(0, len(items), _METRICS_PER_CALL):
            self._client.log_batch(self.run_id, metrics=items[start:start + _METRICS_PER_CALL])

    @override
    def _upload(self, path: Path) -> None:
        self._client.log_artifact(self.run_id, str(path))

    @override
    def _finish(self, status: str) -> None:
        self._client.set_terminated(self.run_id, status=status)
