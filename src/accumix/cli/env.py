"""``accumix env``: devices, precision support, the launcher and world this process sees."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import logging
import os
import platform
import sys

from accumix.cli.launch import local_cpus, resolve_nproc, slurm_settings
from accumix.errors import ConfigError


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def describe() -> list[tuple[str, str]]:
    """``(label, value)`` lines describing this machine and launch."""
    import torch
    import torch.distributed as dist

    from accumix.precision.policy import cpu_has_native_bf16, resolve_policy
    from accumix.runtime.env import detect_launch_env

    lines = [
        ("accumix", _version("accumix")),
        ("python", platform.python_version()),
        ("torch", torch.__version__),
        ("platform", f"{platform.system()} {platform.machine()}"),
        ("cpu cores", f"{local_cpus()} usable (of {os.cpu_count()})"),
        ("cpu bf16", "native" if cpu_has_native_bf16() else "emulated (slower than fp32)"),
    ]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            bf16 = "bf16" if torch.cuda.is_bf16_supported() else "fp16 only"
            lines.append((f"cuda:{i}", f"{props.name}, {props.total_memory / 2**30:.1f} GiB, "
                                       f"capability {props.major}.{props.minor}, {bf16}"))
    else:
        lines.append(("gpus", "none (CUDA not available)"))
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    quiet = logging.getLogger("accumix")
    level, quiet.level = quiet.level, logging.WARNING  # resolve_policy logs its reason
    try:
        auto = resolve_policy("auto", device).name
    finally:
        quiet.level = level
    lines.append(("precision auto", f"{auto} on {device}"))
    backends = [name for name, ok in (("gloo", dist.is_gloo_available()),
                                      ("nccl", dist.is_nccl_available()),
                                      ("mpi", dist.is_mpi_available())) if ok]
    lines.append(("backends", ", ".join(backends) or "none"))
    launch = detect_launch_env()
    lines.append(("launcher", f"{launch.launcher}: rank {launch.rank} of world "
                              f"{launch.world_size}, local rank {launch.local_rank}"))
    if "SLURM_JOB_ID" in os.environ:
        try:
            slurm = ", ".join(f"{k} {v}" for k, v in slurm_settings(os.environ).items())
        except ConfigError as exc:
            slurm = str(exc)
        lines.append(("slurm", f"job {os.environ['SLURM_JOB_ID']}: {slurm}"))
    try:
        lines.append(("launch auto", f"{resolve_nproc('auto')} process(es) on this node"))
    except ConfigError as exc:
        lines.append(("launch auto", str(exc)))
    for package in ("deepspeed", "tensorboard", "matplotlib"):
        found = importlib.util.find_spec(package) is not None
        lines.append((package, _version(package) if found else "not installed"))
    return lines


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("env", help="show devices, precision support and the world",
                                   description="Show this machine's devices, precision support, "
                                   "the detected launcher and world, and optional packages.")
    parser.set_defaults(run=run_env)


def run_env(args: argparse.Namespace) -> int:
    lines = describe()
    width = max(len(label) for label, _ in lines)
    for label, value in lines:
        print(f"{label.ljust(width)}  {value}")
    sys.stdout.flush()
    return 0
