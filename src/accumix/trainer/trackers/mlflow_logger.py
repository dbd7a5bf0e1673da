"""MLflow: a SQLite store in the run directory unless ``MLFLOW_TRACKING_URI`` or ``tracking_uri``
points elsewhere (``pip install 'accumix[mlflow]'``).

Metrics are indexed by optimizer step. On a resume, the points after the checkpoint's step (the
steps the job is about to repeat) are deleted first from a store on this machine (SQL through
MLflow's own tables, with each metric's latest value recomputed from the points left, so a key
the resumed job does not log again keeps its place; a ``file:`` store's metric files), so every
step keeps one value; MLflow's API has no way to delete metric points, so on a tracking server
the repeated steps show both values (README, "Experiment trackers").

Params are write-once: the first attempt's values keep their names, and an attempt that runs
with other values (an elastic restart on another world size, a larger ``max_steps``) adds them
as ``attempt<N>.<key>``.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from typing_extensions import override

from accumix.common.redact import redact
from accumix.common.safe_write import refuse_link, replace_text
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

    def _uri(self, run_dir: Path) -> tuple[str, bool]:
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if uri:
            return uri, False
        # A link planted there would make MLflow write into its target.
        return f"sqlite:///{refuse_link(run_dir / 'mlflow.db').resolve()}", True

    def _artifact_location(self, uri: str, local: bool) -> str | None:
        """Where a new experiment keeps its artifacts: beside a SQLite file (MLflow's own
        default for a database store is ``./mlruns`` of whatever directory the job runs in);
        a server or a ``file:`` store decides for itself."""
        assert self.run_dir is not None
        if local:
            return (self.run_dir / "mlflow-artifacts").resolve().as_uri()
        if uri.startswith("sqlite:///") and uri != "sqlite:///:memory:":
            database = Path(uri[len("sqlite:///"):].split("?")[0])
            return (database.parent / "mlflow-artifacts").resolve().as_uri()
        return None

    @override
    def check(self, run_dir: Path) -> None:
        super().check(run_dir)
        from mlflow.tracking import MlflowClient

        uri, local = self._uri(Path(run_dir))
        if local:
            os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        # MLflow says "Creating initial MLflow database tables...": the job's business, not
        # the launcher's
        quiet = logging.getLogger("mlflow.store.db.utils")
        level = quiet.level
        quiet.setLevel(logging.WARNING)
        try:
            MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
        except Exception as exc:
            raise self._location_error(uri, exc) from None
        finally:
            quiet.setLevel(level)

    @staticmethod
    def _location_error(uri: str, exc: BaseException) -> ConfigError:
        return ConfigError(f"mlflow cannot use the tracking location {redact(uri)!r} "
                           f"({first_line(exc)})"
                           "; set MLFLOW_TRACKING_URI or tracking_uri= to a writable place or a "
                           "reachable server")

    @override
    def _start(self, saved: dict[str, Any] | None, resume_step: int) -> dict[str, Any]:
        from mlflow.tracking import MlflowClient

        assert self.run_dir is not None
        uri, local = self._uri(self.run_dir)
        if local:  # local means no network: MLflow 3's usage telemetry stays off unless asked
            os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        # trackers.json keeps the location with its password masked (older files: in clear).
        if saved and redact(str(saved.get("tracking_uri", uri))) != redact(uri):
            log.warning("mlflow: this run directory's run %s is in %s, not %s; starting a new "
                        "run there", saved["run_id"], redact(str(saved["tracking_uri"])),
                        redact(uri))
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
                    experiment_id = client.create_experiment(
                        name, artifact_location=self._artifact_location(uri, local))
                else:
                    experiment_id = experiment.experiment_id
                run_id = client.create_run(experiment_id, run_name=self.run_name).info.run_id
        except Exception as exc:  # sqlalchemy, OSError, MlflowException: one line for the user
            raise self._location_error(uri, exc) from None
        return {"run_id": run_id, "tracking_uri": redact(uri)}

    def _forget_after(self, run_id: str, step: int) -> None:
        """Deletes the run's metric points after ``step`` (the steps a resumed job repeats)
        from a SQL or ``file:`` store. MLflow has no API for it: its own tables (ORM models and
        session) and its metric files are edited."""
        try:
            from mlflow.store.tracking.file_store import FileStore
            from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

            store = self._client._tracking_client.store
            if isinstance(store, SqlAlchemyStore):
                _forget_sql(store, run_id, step)
            elif isinstance(store, FileStore):
                _forget_files(store, self._client.get_run(run_id).info.experiment_id, run_id,
                              step)
            else:
                log.warning("mlflow: the tracking server cannot delete metric points; steps "
                            "after %d that the job repeats will show two values (the later "
                            "one this attempt's)", step)
        except Exception as exc:  # an MLflow whose internals moved: keep the duplicates
            log.warning("mlflow: could not drop the points after step %d (%s); the repeated "
                        "steps will show two values", step, first_line(exc))

    @override
    def _params(self, params: dict[str, Any], tags: dict[str, str]) -> None:
        from mlflow.entities import Param, RunTag

        assert self.run_id is not None
        existing = self._client.get_run(self.run_id).data.params
        values = {mlflow_key(k): str(v)[:_VALUE_LIMIT] for k, v in params.items()}
        # MLflow params are write-once: a resumed attempt logs what is new under its name, and
        # what it changed (the world size after an elastic restart, a larger max_steps) as
        # attempt<N>.<key>, so the params never state a stale value as this attempt's.
        changed = sorted(k for k, v in values.items() if k in existing and existing[k] != v)
        if changed:
            log.info("mlflow: attempt %d of run %s changed %s; logged as attempt%d.<key>",
                     self.attempt, self.run_id, ", ".join(changed), self.attempt)
        values.update({mlflow_key(f"attempt{self.attempt}.{k}"): values[k] for k in changed})
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
        # MLflow has no pre-empted status: KILLED (ended from outside) until the requeued job
        # sets it RUNNING again.
        self._client.set_terminated(self.run_id,
                                    status="KILLED" if status == "PREEMPTED" else status)


def _forget_sql(store: Any, run_id: str, step: int) -> None:
    """Deletes the points after ``step`` and puts back each deleted latest value as the newest
    point left (MLflow's order: step, then timestamp, then value): ``run.data.metrics`` and
    ``search_runs`` read the latest-metrics table, and a key the resumed job never logs again
    (``system/rank1/...`` on fewer ranks) would vanish from them."""
    from mlflow.store.tracking.dbmodels.models import SqlLatestMetric, SqlMetric

    try:  # MLflow 3 marks write sessions (and refuses writes in others under pytest)
        writing = store.ManagedSessionMaker(read_only=False)
    except TypeError:  # an MLflow before that flag
        writing = store.ManagedSessionMaker()
    with writing as session:
        session.query(SqlMetric).filter(SqlMetric.run_uuid == run_id,
                                        SqlMetric.step > step).delete()
        stale = session.query(SqlLatestMetric).filter(SqlLatestMetric.run_uuid == run_id,
                                                      SqlLatestMetric.step > step)
        keys = [row.key for row in stale]
        stale.delete()
        for key in keys:
            newest = session.query(SqlMetric).filter(
                SqlMetric.run_uuid == run_id, SqlMetric.key == key).order_by(
                SqlMetric.step.desc(), SqlMetric.timestamp.desc(),
                SqlMetric.value.desc()).first()
            if newest is not None:
                session.add(SqlLatestMetric(key=key, value=newest.value,
                                            timestamp=newest.timestamp, step=newest.step,
                                            is_nan=newest.is_nan, run_uuid=run_id))


def _forget_files(store: Any, experiment_id: str, run_id: str, step: int) -> None:
    """Rewrites each metric file of a ``file:`` store without its points after ``step`` (a
    line is ``timestamp value step [dataset]``; the latest value is read from the file)."""
    folder = Path(store._get_run_dir(experiment_id, run_id)) / "metrics"
    for path in folder.rglob("*"):
        if not path.is_file():
            continue
        lines = path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if len(line.split()) < 3 or int(line.split()[2]) <= step]
        if len(kept) != len(lines):
            # The temporary file outside metrics/: never read as a metric.
            replace_text(path, "".join(kept), durable=False,
                         tmp=folder.parent / ".accumix-metric.tmp")
