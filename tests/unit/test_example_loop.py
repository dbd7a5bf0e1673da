"""examples/train_loop.py, the README's plain loop as a program, runs and its loss falls."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_loop.py"


def test_plain_loop_example_learns() -> None:
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "20", "--global-batch", "16",
         "--micro-batch", "8", "--val-bytes", "20000"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    assert "1 process(es), strategy single, precision fp32, K=2" in out
    losses = [float(x) for x in re.findall(r"step +\d+  loss/token (\d+\.\d+)", out)]
    assert len(losses) == 2 and losses[1] < losses[0] < 5.6  # ln(256) = 5.55 at the start
    assert re.search(r"validation loss/token \d+\.\d+", out)
