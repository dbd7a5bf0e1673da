"""bench/jax_accum.py runs in its tiny configuration and prints the table it promises.

The script runs as users run it (``python bench/jax_accum.py --tiny``), in its own process: it
sets ``KERAS_BACKEND=jax`` before Keras is imported and wants one CPU device, not the two that
tests/conftest.py gives this process. Its time is imports and a few dozen small XLA
compilations; LLVM's optimisation level 0 compiles them faster (it changes no assertion here:
every method and its reference are compiled alike).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")
pytest.importorskip("optax")

from tests.unit.test_bench_smoke import parse_table  # noqa: E402
from tests.xla_flags import FAST_COMPILE  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 120
HEADERS = ["method", "ms / optimizer step (wall, median)", "x accumix (wall)",
           "x accumix, middle half", "CPU ms / step (median)", "x accumix (CPU)",
           "XLA temp MiB", "state MiB", "AdamW: max abs param diff vs large batch",
           "max abs grad diff vs large batch"]
ROWS = ["accumix.jax", "optax MultiSteps", "Keras 3 gradient_accumulation_steps",
        "accumix.jax again (control)"]


def test_jax_accum_table() -> None:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = FAST_COMPILE  # a smoke run: the table's shape, not its speed
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "bench/jax_accum.py", "--tiny"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, f"bench/jax_accum.py failed:\n{proc.stderr[-3000:]}"
    headers, rows = parse_table(proc.stdout)
    assert headers == HEADERS
    by_name = {row[0]: row for row in rows}
    assert list(by_name) == ROWS
    mine, multisteps = by_name["accumix.jax"], by_name["optax MultiSteps"]
    assert mine[2:4] == ["1", "1.00 - 1.00"]  # accumix's rounds against themselves
    for row in (mine, multisteps, by_name["accumix.jax again (control)"]):
        assert float(row[1]) > 0 and float(row[2]) > 0 and float(row[4]) > 0, row
    # Exact: item-weighted accumulation lands on the large batch, in parameters and gradient.
    assert float(mine[8]) < 1e-6 and float(mine[9]) < 1e-6, mine
    assert float(by_name["accumix.jax again (control)"][8]) < 1e-6
    # The mean of micro-batch means is far off on ragged tokens: the check has power.
    assert float(multisteps[8]) > 1e-3 and float(multisteps[9]) > 1e-3, multisteps
    for row in (mine, multisteps):
        assert float(row[6]) >= 0 and float(row[7]) > 0, row  # memory was measured
    keras = by_name["Keras 3 gradient_accumulation_steps"]
    if importlib.util.find_spec("keras") is None:
        assert keras[1].startswith("n/a: "), keras  # not installed: the row says why
    else:
        assert float(keras[1]) > 0 and float(keras[8]) > 1e-3 and float(keras[9]) > 1e-3, keras


def test_jax_fsdp_peak_breakdown_adds_up() -> None:
    """bench/jax_fsdp_peak.py (issue 30) on the 2-layer flax GPT: each row's parts, read from
    XLA's own live-range dump at its peak, add up to ``memory_analysis()``'s arguments +
    temporaries; fsdp's activations at its peak are no more than plain JAX's when its backward
    starts; and plain's ``temp_size`` undercounts those (XLA keeps some in the buffers of the
    gradients it returns), which is why the floor is read from the dump."""
    import re

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = FAST_COMPILE  # buffer assignment, and so the dump, is the same
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "bench/jax_fsdp_peak.py", "--layers", "2",
                           "--strategies", "fsdp", "fsdp-sync"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, f"bench/jax_fsdp_peak.py failed:\n{proc.stderr[-3000:]}"
    plain = re.search(r"temp_size ([\d.]+) MiB; activations when its backward starts "
                      r"([\d.]+) MiB, ([\d.]+) of them", proc.stdout)
    assert plain, proc.stdout
    temp, activations, parked = map(float, plain.groups())
    assert parked > 0.5 and activations > temp, plain.groups()
    headers, rows = parse_table(proc.stdout)
    assert headers == ["strategy", "measured", "arguments", "carried", "activations",
                       "gathered", "other backward", "other", "packing", "floor"]
    assert [row[0] for row in rows] == ["fsdp", "fsdp-sync"]
    for row in rows:
        measured, *parts, floor = (float(cell.split()[0]) for cell in row[1:])
        assert abs(sum(parts) - measured) <= 0.4, row  # 8 cells rounded to 0.1 MiB
        assert floor == pytest.approx(sum(parts[:4]), abs=0.25) and floor <= measured, row
        assert 0 < parts[2] <= activations, row  # no more activations than plain JAX keeps
        assert parts[3] > 0, row  # a gathered weight alive for the backward
