"""accumix: one PyTorch training loop on a CPU, a GPU, many GPUs and many machines.

Gradient accumulation and mixed precision are correct by default: accumulation equals the large
batch (token-weighted too), the short last window is divided by its true size, fp16 overflow
decisions agree across ranks, and resume is exact.
"""

from __future__ import annotations

import importlib
from typing import Any

from accumix.common.preemption import request_preemption
from accumix.errors import (
    AccumixError,
    CheckpointError,
    CompileError,
    ConfigError,
    LossScaleError,
    Preempted,
)
from accumix.precision.loss_scale import DynamicLossScale, NoLossScale

__version__ = "0.1.0"

# Everything that imports torch loads on first use: `import accumix.jax` shares the errors and
# the loss-scale algorithm without paying for torch. Sharded strategies load torch's FSDP / ZeRO
# machinery (about a second) only when named.
_LAZY = {
    "Accelerator": "accumix.accelerator",
    "DDPStrategy": "accumix.strategies",
    "Policy": "accumix.precision.policy",
    "SingleDeviceStrategy": "accumix.strategies",
    "Strategy": "accumix.strategies",
    "DeepSpeedStrategy": "accumix.strategies.deepspeed",  # imports deepspeed only when built
    "FSDPStrategy": "accumix.strategies.fsdp",
    "HSDPStrategy": "accumix.strategies.hsdp",
    "ZeRO1Strategy": "accumix.strategies.zero1",
}
# The Trainer layer (tqdm, loggers): imported on first use too.
_TRAINER = (
    "CSVLogger", "Callback", "EarlyStopping", "FitResult", "GradientAccumulationScheduler",
    "JSONLLogger", "LRMonitor", "LossGuard", "MetricLogger", "ProgressBar", "StepMetrics",
    "StragglerMonitor", "TensorBoardLogger", "ThroughputMonitor", "Trainer", "WarmupDecay",
    "load_config", "scale_lr", "warmup_schedule",
)
_LAZY.update(dict.fromkeys(_TRAINER, "accumix.trainer"))
# Experiment trackers (optional extras): their libraries load only when a run opens.
_TRACKERS = {
    "ClearMLLogger": "accumix.trainer.trackers.clearml_logger",
    "MLflowLogger": "accumix.trainer.trackers.mlflow_logger",
    "WandbLogger": "accumix.trainer.trackers.wandb_logger",
}
_LAZY.update(_TRACKERS)

__all__ = [
    "AccumixError",
    "Accelerator",
    "CheckpointError",
    "CompileError",
    "ConfigError",
    "DDPStrategy",
    "DeepSpeedStrategy",
    "DynamicLossScale",
    "FSDPStrategy",
    "HSDPStrategy",
    "LossScaleError",
    "NoLossScale",
    "Preempted",
    "Policy",
    "SingleDeviceStrategy",
    "Strategy",
    "ZeRO1Strategy",
    "__version__",
    "request_preemption",
    *_TRAINER,
    *_TRACKERS,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'accumix' has no attribute {name!r}")
