"""Every test leaves no process group and no changed environment behind."""

from __future__ import annotations

import os

# Two CPU devices for accumix.jax's multi-device tests; must be set before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402


@pytest.fixture(autouse=True)
def _clean_process_state():
    saved = dict(os.environ)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)
