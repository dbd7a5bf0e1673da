"""The benchmark scripts run in their tiny configurations and print the tables they promise.

The scripts run as users run them (``python bench/NAME.py``), side by side in one process each,
so this costs the slowest of them (a few seconds), not their sum.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OVERHEAD_ARGS = ["--rounds", "2", "--warmup", "1", "--steps", "3", "--width", "16", "--batch", "4"]
GPU_ROWS = "raw,bf16,accelerate,fp16,fp32,fsdp"
TIMEOUT = 120


def parse_table(stdout: str) -> tuple[list[str], list[list[str]]]:
    """The Markdown table at the end of a script's output: headers and rows of cells."""
    lines = [line for line in stdout.splitlines() if line.startswith("|")]
    assert len(lines) >= 3, f"no table in the output:\n{stdout}"
    split = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    assert stdout.rstrip().splitlines()[-1].startswith("|"), "the table is not printed last"
    return split[0], split[2:]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    json_path = tmp_path_factory.mktemp("bench") / "gpu.json"
    commands = {
        "overhead": [sys.executable, "bench/overhead.py", *OVERHEAD_ARGS],
        # The rows a CPU runs, named so the test reads the same on a machine with CUDA.
        "gpu": [sys.executable, "bench/gpu.py", "--tiny", "--rows", GPU_ROWS,
                "--json", str(json_path)],
        "compile": [sys.executable, "bench/compile.py", "--tiny", "--backend", "eager",
                    "--steps", "1", "--rows", "single-fp32"],
        # One 2-rank job through the real launcher (a few seconds: 3 processes import torch).
        "stress": [sys.executable, "bench/stress.py", "--quick"],
        "sample_seeds": [sys.executable, "bench/sample_seeds.py", "--samples", "128",
                         "--repeats", "1"],
        "checkpoint": [sys.executable, "bench/checkpoint.py", "--width", "64", "--layers", "2",
                       "--saves", "2"],
    }
    # One thread each: two processes share the cores instead of fighting over them.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    running = {name: subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
               for name, cmd in commands.items()}
    results: dict[str, object] = {}
    for name, proc in running.items():
        out, err = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == 0, f"bench/{name}.py failed:\n{err[-3000:]}"
        results[name] = out
    results["gpu.json"] = json.loads(json_path.read_text())
    return results


def test_overhead_table(outputs: dict[str, object]) -> None:
    headers, rows = parse_table(str(outputs["overhead"]))
    assert headers == ["variant", "ms / optimizer step (median)", "x raw loop",
                       "x raw, middle half", "+us / step vs raw", "min ms / step", "rounds",
                       "max abs param diff vs raw"]
    by_name = {row[0]: row for row in rows}
    assert list(by_name) == ["raw PyTorch", "accumix", "HF Accelerate", "Lightning Fabric",
                             "raw PyTorch again (control)"]
    # raw's rounds against themselves
    assert by_name["raw PyTorch"][2:5] == ["1", "1.000 - 1.000", "+0"]
    for name, module in [("raw PyTorch", None), ("accumix", None), ("HF Accelerate", "accelerate"),
                         ("Lightning Fabric", "lightning"), ("raw PyTorch again (control)", None)]:
        row = by_name[name]
        if module is not None and importlib.util.find_spec(module) is None:
            assert row[1].startswith("n/a: "), row  # not installed: the row says why
            continue
        assert float(row[1]) > 0 and float(row[2]) > 0 and row[6] == "2", row
        # Same job, same maths: every library ends at raw's weights (to float tolerance).
        assert float(row[7]) <= 1e-6, row


def test_gpu_table_on_cpu(outputs: dict[str, object]) -> None:
    headers, rows = parse_table(str(outputs["gpu"]))
    assert headers == ["row", "steps (real)", "tokens/s", "x raw bf16", "x fp32", "MFU %",
                       "peak mem GiB", "last train loss", "held-out loss", "loss vs fp32 %"]
    by_label = {row[0]: row for row in rows}
    assert list(by_label) == ["raw PyTorch, bf16 autocast", "accumix bf16-mixed",
                              "HF Accelerate bf16", "accumix fp16-mixed", "accumix fp32",
                              "accumix fsdp bf16-mixed"]
    has_accelerate = importlib.util.find_spec("accelerate") is not None
    for label, row in by_label.items():
        if label == "accumix fsdp bf16-mixed" and row[2].startswith("n/a: "):
            continue  # one process: fsdp shards nothing, and the row says so
        if label == "HF Accelerate bf16" and not has_accelerate:
            assert row[2].startswith("n/a: "), row  # not installed: the row says why
            continue
        # 1 warm-up step + 2 windows of 1 step, each a real update (no fp16 overflow here).
        assert row[1] == "3 (3)", row
        assert float(row[2].replace(",", "")) > 0, row
        assert math.isfinite(float(row[8])) and math.isfinite(float(row[9])), row
    assert by_label["accumix fp32"][4] == "1" and by_label["accumix fp32"][9] == "+0.00"

    records = {r["row"]: r for r in outputs["gpu.json"]["rows"]}  # full precision
    fp32 = records["accumix fp32"]["val_loss"]
    assert 4.0 < fp32 < math.log(256) + 0.1  # byte-level text, barely trained: about ln 256
    bf16_rows = ["raw PyTorch, bf16 autocast", "accumix bf16-mixed"]
    bf16_rows += ["HF Accelerate bf16"] if has_accelerate else []
    for label in [*bf16_rows, "accumix fp16-mixed"]:
        assert abs(records[label]["loss_vs_fp32_pct"]) < 1.0, records[label]
    # raw, accumix and Accelerate under bf16 do the same arithmetic in the same order.
    bf16 = {records[label]["val_loss"] for label in bf16_rows}
    assert len(bf16) == 1, bf16


def test_compile_table(outputs: dict[str, object]) -> None:
    headers, rows = parse_table(str(outputs["compile"]))
    assert headers == ["strategy", "precision", "eager tokens/s", "compiled tokens/s", "x eager",
                       "x eager (wall)", "eager s/step", "compiled s/step", "compile s (wall)",
                       "loss step 1 eager / compiled"]
    assert [row[:2] for row in rows] == [["single", "fp32"]]
    assert float(rows[0][4]) > 0 and float(rows[0][5]) > 0
    eager_loss, compiled_loss = rows[0][9].split(" / ")
    assert eager_loss == compiled_loss  # the same weights, data and arithmetic


def test_stress_counts_the_jobs_exit(outputs: dict[str, object]) -> None:
    out = str(outputs["stress"])
    headers, rows = parse_table(out)
    assert headers == ["strategy", "ending", "jobs", "abnormal"]
    assert rows == [["zero1", "no-end", "1", "0"]]  # a finished job exits 0, without SIGABRT
    assert "abnormal exits: 0 of 1 (0.0%)" in out and "zero1: 0 of 1 abnormal" in out


def test_sample_seeds_table(outputs: dict[str, object]) -> None:
    headers, rows = parse_table(str(outputs["sample_seeds"]))
    assert headers == ["loader", "epoch ms", "x", "us/sample"]
    assert [r[0] for r in rows] == ["plain", "accumix", "plain, TensorDataset",
                                    "accumix, TensorDataset"]
    assert rows[0][2] == rows[2][2] == "1.000x"  # each baseline against itself
    assert all(float(r[1]) > 0 for r in rows)


def test_checkpoint_table(outputs: dict[str, object]) -> None:
    headers, rows = parse_table(str(outputs["checkpoint"]))
    assert headers == ["save", "loop blocked s (median)", "write to published s (median)",
                       "blocked / in-loop save"]
    assert [row[0] for row in rows] == ["in the loop", "background"]
    assert rows[0][3] == "1.000" and all(float(cell) > 0 for row in rows for cell in row[1:])
    assert "2 saves each" in str(outputs["checkpoint"])
