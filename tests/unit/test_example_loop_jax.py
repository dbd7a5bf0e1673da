"""examples/train_loop_jax.py, the README's JAX loop as a program, runs and learns."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_loop_jax.py"


def test_jax_loop_example_learns() -> None:
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "20", "--global-batch", "16",
         "--micro-batch", "8", "--val-bytes", "20000"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    assert re.search(r"1 process\(es\), 2 device\(s\), strategy ddp, precision fp32, K=2", out)
    losses = [float(x) for x in re.findall(r"step +\d+  loss/token (\d+\.\d+)", out)]
    assert len(losses) == 2 and losses[1] < losses[0] < 5.6  # ln(256) = 5.55 at the start
    val = float(re.search(r"validation loss/token (\d+\.\d+)", out).group(1))
    assert val < 4.5
    assert "sample:\ndef " in out
