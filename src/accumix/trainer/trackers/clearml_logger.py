"""ClearML: an offline session in ``run_dir/clearml/`` unless a server is configured
(``CLEARML_API_HOST`` or a ``clearml.conf``) (``pip install 'accumix[clearml]'``).

A metric ``a/b/c`` is reported as graph ``a/b``, series ``c`` (``loss``: graph and series
``loss``), at iteration = the optimizer step. ClearML's own framework patching, argparse and
console capture and its per-machine resource monitor stay off: accumix reports per-rank system
metrics itself. Online, a resumed job continues the same task (``continue_last_task``);
offline, each attempt is a session of its own whose ids ``trackers.json`` lists in order, for
``Task.import_offline_session(zip, previous_task_id=...)``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from typing_extensions import override

from accumix.errors import ConfigError, Preempted
from accumix.trainer.trackers.base import TrackerLogger, first_line

# run_outcome's words in ClearML's (its own at-exit hook marks Ctrl-C "stopped")
_STATUS = {"FINISHED": "completed", "FAILED": "failed", "KILLED": "stopped",
           "PREEMPTED": "stopped"}

# Every framework ClearML would patch, off: an empty dict would mean "all on" in some versions.
_NO_FRAMEWORKS = {name: False for name in (
    "matplotlib", "tensorflow", "tensorboard", "pytorch", "xgboost", "scikit", "fastai",
    "lightgbm", "hydra", "detect_repository", "tfdefines", "joblib", "megengine", "catboost",
    "gradio", "jsonargparse")}

_cache_dir_we_set: str | None = None


def server_configured() -> bool:
    """Whether the environment points ClearML at a server (and offline mode was not asked)."""
    if os.environ.get("CLEARML_OFFLINE_MODE", "").lower() in ("1", "true", "yes"):
        return False
    if os.environ.get("CLEARML_API_HOST"):
        return True
    conf = os.environ.get("CLEARML_CONFIG_FILE") or os.path.expanduser("~/clearml.conf")
    return os.path.isfile(conf)


class ClearMLLogger(TrackerLogger):
    """One ClearML task per job (an offline session unless a server is configured).

    Args:
        project: the ClearML project (default ``accumix``).
        offline: force offline (True) or online (False); default: offline unless a server is
            configured.
        log_model: upload the final ``model.safetensors`` as the task's ``model`` artifact.
        run_name: the task's name (default: the run directory's name).

    Raises:
        ConfigError: clearml is not installed.
    """

    word = "clearml"
    module = "clearml"

    def __init__(self, *, project: str = "accumix", offline: bool | None = None,
                 log_model: bool = False, run_name: str | None = None) -> None:
        super().__init__(log_model=log_model, run_name=run_name)
        self.project = project
        self.offline = offline
        self._task: Any = None
        self._offline = False

    @override
    def _start(self, saved: dict[str, Any] | None, resume_step: int) -> dict[str, Any]:
        from clearml import Task

        assert self.run_dir is not None
        offline = self.offline if self.offline is not None else not server_configured()
        sessions: list[str] = list(saved.get("offline_sessions", [])) if saved else []
        try:
            if offline:
                # ClearML keeps offline sessions in its cache folder, read from here at use;
                # a folder the user set stays, one we set for an earlier run is replaced.
                global _cache_dir_we_set
                if os.environ.get("CLEARML_CACHE_DIR") in (None, _cache_dir_we_set):
                    _cache_dir_we_set = str(self.run_dir.resolve() / "clearml")
                    os.environ["CLEARML_CACHE_DIR"] = _cache_dir_we_set
                # sdk.development.report_use_subprocess=false for the offline session: the
                # subprocess reporter's shutdown waits about 16 s at close; rows come from
                # one thread at step boundaries, which the thread reporter serves.
                Task._report_subprocess_enabled = False
                Task.set_offline(True)
            continue_id = saved["run_id"] if saved and not offline else False
            self._task = Task.init(
                project_name=self.project, task_name=self.run_name, reuse_last_task_id=False,
                continue_last_task=continue_id, auto_connect_frameworks=_NO_FRAMEWORKS,
                auto_connect_arg_parser=False, auto_connect_streams=False,
                auto_resource_monitoring=False)
        except Exception as exc:
            raise ConfigError(f"clearml cannot start a task for {str(self.run_dir)!r} "
                              f"({first_line(exc)}); check CLEARML_API_HOST / clearml.conf, or "
                              "give a writable run_dir for an offline session") from None
        self._offline = offline
        if offline:
            sessions.append(self._task.id)
        run_id = saved["run_id"] if saved else self._task.id
        return {"run_id": run_id, "offline": offline, "offline_sessions": sessions}

    @override
    def _params(self, params: dict[str, Any], tags: dict[str, str]) -> None:
        self._task.connect({k: v if isinstance(v, (int, float, str, bool)) else str(v)
                            for k, v in params.items()}, name="accumix")
        if tags:
            self._task.add_tags([f"{k}:{v}" for k, v in tags.items()])

    @override
    def _metrics(self, metrics: dict[str, float], step: int) -> None:
        logger = self._task.get_logger()
        for key, value in metrics.items():
            graph, _, series = key.rpartition("/")
            logger.report_scalar(graph or series, series, value, iteration=step)

    @override
    def _upload(self, path: Path) -> None:
        self._task.upload_artifact("model", artifact_object=str(path), wait_on_upload=True)

    @override
    def _finish(self, status: str) -> None:
        task, self._task = self._task, None
        exc = sys.exc_info()[1]
        reason = first_line(exc) if exc is not None and status != "FINISHED" else status.lower()
        if isinstance(exc, Preempted):
            reason = f"pre-empted: saved step {exc.step}; the requeued job continues it"
        if self._offline:
            # Offline, ClearML's status calls send nothing and close() leaves no status in the
            # session's task.json: the status is written into the task's data, which close()
            # saves there.
            task._edit(status=_STATUS[status], status_reason=reason)
            task.close()
            return
        # close() marks the task completed unless ClearML's own exit hook saw an uncaught
        # exception, which an exception being handled (the Trainer's failure path) is not:
        # the status is forced after it.
        task.close()
        if status == "FAILED":
            task.mark_failed(status_reason=reason, force=True)
        elif status in ("KILLED", "PREEMPTED"):
            task.stopped(status_reason=reason, force=True)
