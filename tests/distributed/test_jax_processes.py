"""accumix.jax on 2 processes under ``accumix launch`` (jax.distributed, gloo on loopback).

One job trains ddp and fsdp on 2 processes x 2 CPU devices against the one-device large batch
and saves fsdp's state mid-run; new processes resume it bitwise; one process loads it resharded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "jax_train.py"
ACCUMIX = [sys.executable, "-m", "accumix.cli.main"]


def _env(devices: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _run(cmd: list[str], devices: int) -> None:
    done = subprocess.run(cmd, env=_env(devices), capture_output=True, text=True, timeout=240,
                          cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _results(out: Path, mode: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"{mode}-*.json"))]


def test_two_processes_train_resume_bitwise_and_reshard_to_one(tmp_path: Path) -> None:
    _run([*ACCUMIX, "launch", "--nproc", "2", str(SCRIPT), str(tmp_path), "train"], devices=2)
    trained = _results(tmp_path, "train")
    assert [(r["process"], r["processes"], r["devices"]) for r in trained] == [
        (0, 2, 4), (1, 2, 4)]
    for r in trained:
        assert r["ddp"] < 1e-6 and r["fsdp"] < 1e-6, r
    meta = json.loads((tmp_path / "run" / "step-2" / "meta.json").read_text())
    assert (meta["num_processes"], meta["num_devices"], meta["strategy"]) == (2, 4, "fsdp")

    _run([*ACCUMIX, "launch", "--nproc", "2", str(SCRIPT), str(tmp_path), "resume"], devices=2)
    resumed = _results(tmp_path, "resume")
    assert [(r["loaded_step"], r["bitwise"]) for r in resumed] == [(2, True), (2, True)]

    _run([sys.executable, str(SCRIPT), str(tmp_path), "reshard", "2"], devices=1)
    (resharded,) = _results(tmp_path, "reshard")
    assert (resharded["processes"], resharded["devices"], resharded["loaded_step"]) == (1, 1, 2)
    assert resharded["max_diff"] < 1e-6


def test_processes_launched_with_different_settings_stop_naming_both(tmp_path: Path) -> None:
    _run([*ACCUMIX, "launch", "--nproc", "2", str(SCRIPT), str(tmp_path), "mismatch"],
         devices=1)
    messages = _results(tmp_path, "mismatch")
    assert len(messages) == 2 and messages[0] == messages[1]
    assert "processes disagree" in messages[0] and "(2, None, None)" in messages[0]
    assert "(3, None, None)" in messages[0]
