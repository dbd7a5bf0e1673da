"""The recipe's logger settings for the Trainer, and the final weights written before the
trackers close (so ``log_model=true`` can upload them); shared by both backends' recipes."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from accumix.trainer.events import Callback

if TYPE_CHECKING:
    from accumix.recipes.default import TrainConfig


def tracking_options(config: TrainConfig) -> dict[str, Any]:
    """The Trainer's logger keywords from the config: the loggers, ``log_model``, the system
    metrics' interval, the job's name and the resolved config (logged as trackers' params)."""
    from accumix.trainer.config import to_dict

    return {"loggers": list(config.loggers) if config.loggers is not None else None,
            "log_model": config.log_model, "run_name": config.name,
            "system_metrics_every": config.system_metrics_every, "config": to_dict(config)}


class SaveModelAtEnd(Callback):
    """Writes the final ``model.safetensors`` in ``on_fit_end`` (collective), before the
    trackers close, so ``log_model=true`` can upload it."""

    def __init__(self, save: Callable[[], Any]) -> None:
        self.save = save

    @override
    def on_fit_end(self, trainer: Any) -> None:
        self.save()
