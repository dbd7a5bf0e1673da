"""Every test leaves no process group and no changed environment behind."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _clean_process_state():
    saved = dict(os.environ)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)
