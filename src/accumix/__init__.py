"""accumix: one PyTorch training loop on a CPU, a GPU, many GPUs and many machines.

Gradient accumulation and mixed precision are correct by default: accumulation equals the large
batch (token-weighted too), the short last window is divided by its true size, fp16 overflow
decisions agree across ranks, and resume is exact.
"""

from __future__ import annotations

from accumix.accelerator import Accelerator
from accumix.errors import AccumixError, ConfigError, LossScaleError
from accumix.precision import DynamicLossScale, NoLossScale, Policy
from accumix.strategies import DDPStrategy, SingleDeviceStrategy, Strategy

__version__ = "0.1.0"

__all__ = [
    "AccumixError",
    "Accelerator",
    "ConfigError",
    "DDPStrategy",
    "DynamicLossScale",
    "LossScaleError",
    "NoLossScale",
    "Policy",
    "SingleDeviceStrategy",
    "Strategy",
    "__version__",
]
