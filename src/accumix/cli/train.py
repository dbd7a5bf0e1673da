"""``accumix train [CONFIG.yaml] [key=value ...]``: the config-driven job, on every local device.

With no arguments it is the default recipe (a small GPT on the stdlib's source). Run by hand
(no launcher around it) with ``nproc`` above 1, it checks the config, then launches itself with
``torch.distributed.run`` on ``nproc`` local processes; under a launcher it trains directly.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

import yaml

from accumix.cli.launch import plan_launch, run_torchrun
from accumix.errors import ConfigError


def split_arguments(items: Sequence[str]) -> tuple[str | None, list[str]]:
    """``[CONFIG.yaml] [key=value ...]`` -> the config path (or None) and the overrides.

    Raises:
        ConfigError: more than one argument without ``=``.
    """
    path: str | None = None
    overrides: list[str] = []
    for item in items:
        if "=" in item:
            overrides.append(item)
        elif path is None and not overrides:
            path = item
        else:
            raise ConfigError(f"unexpected argument {item!r}; give one CONFIG.yaml first, then "
                              "key=value overrides")
    return path, overrides


def load_train_config(items: Sequence[str]) -> object:
    """The ``TrainConfig`` from the command's arguments (file first, then overrides)."""
    from accumix.recipes.default import TrainConfig
    from accumix.trainer.config import load_config

    path, overrides = split_arguments(items)
    return load_config(TrainConfig, path, overrides)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train", help="train from a YAML config (no config: the default recipe)",
        description="Train the config's job on every local device (the default: a small GPT on "
        "the Python standard library's source). Keys: accumix train --print-config.")
    parser.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value]",
                        help="a YAML config, then dotted overrides such as max_steps=50 "
                        "model.n_layer=2")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config as YAML and exit")
    parser.set_defaults(run=run_train)


def run_train(args: argparse.Namespace) -> int:
    from accumix.recipes import default
    from accumix.runtime.env import detect_launch_env
    from accumix.step.accumulation import derive_grad_accum_steps
    from accumix.trainer.config import to_dict

    config = load_train_config(args.items)
    assert isinstance(config, default.TrainConfig)
    if args.print_config:
        print(yaml.safe_dump(to_dict(config), sort_keys=False), end="")
        return 0
    from accumix.recipes.config_checks import check_model_fits

    # Here, not in the config: `accumix estimate-memory` sizes models this host cannot hold.
    check_model_fits(config.model)
    run = default.run
    if config.backend == "jax":
        from accumix.recipes import default_jax

        run = default_jax.run
    launched = detect_launch_env().launcher != "none" or (
        config.backend == "jax" and "JAX_NUM_PROCESSES" in os.environ)  # Kubeflow's JAX runtime
    if launched:  # a launcher or an engine started us: we are one rank
        from accumix.runtime.fault import die_with_launcher

        die_with_launcher()  # the JAX backend's ranks too (the torch Accelerator starts it)
        return run(config)
    plan = plan_launch(nproc=config.nproc)
    # A degenerate mesh is one line here, not one per rank. (JAX's hsdp counts processes as
    # nodes and each process's devices as a node's: its Accelerator checks that mesh.)
    if config.strategy == "hsdp" and config.backend != "jax":
        from accumix.common.launch_env import LaunchEnv
        from accumix.strategies.node_groups import mesh_shape

        mesh_shape(None, LaunchEnv(world_size=plan.nproc * plan.nnodes,
                                   local_world_size=plan.nproc, num_nodes=plan.nnodes))
    # Checked here so a batch that does not divide is one line, not a failure on every rank.
    micro = config.micro_batch_size
    derive_grad_accum_steps(grad_accum_steps=None, global_batch_size=config.global_batch_size,
                            micro_batch_size=None if micro == "auto" else micro,
                            dp_world_size=plan.nproc * plan.nnodes)
    if plan.nproc == 1 and plan.nnodes == 1:
        return run(config)
    check_outputs(config)
    return run_torchrun(plan, "accumix.cli.main", ["train", *args.items], module=True)


def check_outputs(config: object) -> None:
    """Before any rank starts: the run directory is not in use by a live job, and every
    logger can start there (library installed, tracking location usable), so that such an
    error is one line and exit 2, not one failure per rank.

    Raises:
        ConfigError: the first problem found.
    """
    from accumix.recipes.tracking import tracking_options
    from accumix.trainer.loggers import resolve_loggers
    from accumix.trainer.run_lock import check_run_dir_free
    from accumix.trainer.trackers.base import TrackerLogger

    run_dir = config.run_dir  # type: ignore[attr-defined]
    check_run_dir_free(run_dir)
    options = tracking_options(config)  # type: ignore[arg-type]
    for logger in resolve_loggers(options["loggers"], log_model=options["log_model"],
                                  run_name=options["run_name"]):
        if isinstance(logger, TrackerLogger):
            logger.check(run_dir)
