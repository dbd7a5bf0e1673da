"""``accumix estimate-memory``: the memory model's table per strategy and the ``auto`` choice.

Sizes the recipe's model (from the same config and overrides as ``accumix train``; a large one
is built on the meta device, so nothing is allocated) or a bare parameter count (``--params
7e9``), for a world size and a precision. Activations are estimated for the recipe with
Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
section 4.1): per layer
``s*b*h*(34 + 5*a*s/h)`` bytes at 16-bit (twice that in fp32), for sequence s, micro batch b,
width h, heads a.
"""

from __future__ import annotations

import argparse
from typing import Any

from accumix.errors import ConfigError

_BYTES_16 = {"fp32": 2.0, "bf16-mixed": 1.0, "fp16-mixed": 1.0, "bf16-true": 1.0}


def activation_bytes(*, seq: int, micro_batch: int, width: int, heads: int, layers: int,
                     precision: str) -> int:
    """Activation memory of a GPT's forward kept for backward (no recomputation)."""
    per_layer = seq * micro_batch * width * (34 + 5 * heads * seq / width)
    return int(per_layer * layers * _BYTES_16[precision])


def _parse_count(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"--params={text!r} is invalid; use a count such as 124e6") from None
    if value < 1 or value != int(value):
        raise ConfigError(f"--params={text!r} is invalid; use a whole count >= 1")
    return int(value)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "estimate-memory", help="memory per rank for each strategy, and the auto choice",
        description="Print the memory model's bytes per rank for every strategy and what "
        "strategy='auto' would pick. Sizes the train recipe's model (same config and overrides "
        "as accumix train) unless --params is given.")
    parser.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value]",
                        help="the recipe's config and overrides (e.g. model.n_layer=12)")
    parser.add_argument("--params", default=None, help="a parameter count instead of the recipe")
    parser.add_argument("--world-size", type=int, default=None,
                        help="data-parallel ranks over all nodes (default: the recipe's nproc)")
    parser.add_argument("--nodes", type=int, default=1,
                        help="machines the ranks are spread over, the same number on each; "
                        "several add the hsdp rows (fsdp within a node)")
    parser.add_argument("--precision", default=None,
                        help="fp32 | bf16-mixed | fp16-mixed | bf16-true (default: the "
                        "recipe's, auto resolved on this machine)")
    parser.add_argument("--reduce-dtype", default=None,
                        help="fp32 | bf16 | fp16: what gradients travel in (default: the "
                        "recipe's reduce_dtype, else the precision's)")
    parser.add_argument("--grad-accum-steps", type=int, default=None,
                        help="micro-steps per optimizer step: from 2 on fsdp holds the window's "
                        "unsharded gradients (default: the recipe's, 1 with --params)")
    parser.add_argument("--optimizer-states", type=int, default=2,
                        help="states per parameter: 2 Adam, 1 SGD+momentum, 0 SGD")
    parser.add_argument("--device-gib", type=float, default=None,
                        help="memory per rank in GiB (default: free memory of this machine's "
                        "GPU, or its RAM shared by the ranks)")
    parser.add_argument("--backend", choices=("torch", "jax"), default=None,
                        help="whose strategies to size (default: the recipe's backend)")
    parser.set_defaults(run=run_estimate)


def run_estimate(args: argparse.Namespace) -> int:
    import torch

    from accumix.cli.launch import resolve_nproc
    from accumix.cli.train import load_train_config
    from accumix.memory.device_memory import device_free_bytes
    from accumix.memory.model import PRECISIONS, estimate_memory, format_table
    from accumix.memory.strategy_choice import choose_strategy
    from accumix.precision.policy import resolve_policy
    from accumix.recipes.default import TrainConfig
    from accumix.recipes.gpt import GPT

    config = load_train_config(args.items)
    assert isinstance(config, TrainConfig)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    precision = args.precision or config.precision
    if precision == "auto":
        precision = resolve_policy("auto", device).name
    if precision not in PRECISIONS:
        raise ConfigError(f"--precision={precision!r} is invalid; use one of "
                          f"{', '.join(PRECISIONS)}")
    world = args.world_size if args.world_size is not None else resolve_nproc(config.nproc)
    if world < 1:
        raise ConfigError(f"--world-size={world} is invalid; use an integer >= 1")
    if args.nodes < 1 or world % args.nodes:
        raise ConfigError(f"--nodes={args.nodes} is invalid with --world-size={world}; use a "
                          "number of nodes that divides the world size")
    if args.device_gib is not None and not args.device_gib > 0:
        raise ConfigError(f"--device-gib={args.device_gib} is invalid; use a number > 0")
    if args.grad_accum_steps is not None and args.grad_accum_steps < 1:
        raise ConfigError(f"--grad-accum-steps={args.grad_accum_steps} is invalid; use an "
                          "integer >= 1")
    reduce_dtype = reduce_dtype_of(args.reduce_dtype or config.reduce_dtype, precision)
    if (args.backend or config.backend) == "jax":
        if args.nodes > 1 and world // args.nodes < 2:
            raise ConfigError(f"--nodes={args.nodes} leaves one device per node of "
                              f"--world-size={world}: hsdp needs 2 or more; use fewer nodes")
        _host_devices(world)
        # JAX reduces in float32 under every precision unless told (accumix.jax.wire).
        wire = reduce_dtype_of(args.reduce_dtype or config.reduce_dtype or "fp32", precision)
        return _run_jax(args, config, world, precision, wire, args.grad_accum_steps)
    micro = config.micro_batch_size
    if micro == "auto" and args.params is None:
        micro = _probe_recipe(config, world)  # the choice accumix train makes, without training
    model_or_count: torch.nn.Module | int
    if args.params is not None:
        model_or_count = _parse_count(args.params)
        activations = 0
        label = f"{model_or_count:,} parameters (activations not counted)"
    else:
        shape = config.model
        # Small models are built for real: initialising on the meta device first imports
        # torch's decompositions (seconds); big ones must not be allocated.
        rough = 12 * shape.n_layer * shape.n_embd**2
        with torch.device("meta" if rough > 200_000_000 else "cpu"):
            model_or_count = GPT(config.model)
        assert isinstance(micro, int)
        activations = activation_bytes(seq=shape.block_size, micro_batch=micro,
                                       width=shape.n_embd, heads=shape.n_head,
                                       layers=shape.n_layer, precision=precision)
        count = sum(p.numel() for p in model_or_count.parameters())
        label = (f"the recipe's GPT ({count:,} parameters, micro batch "
                 f"{micro} x {shape.block_size} tokens)")
    per_node = world // args.nodes
    device_bytes = (int(args.device_gib * 2**30) if args.device_gib is not None
                    else device_free_bytes(device, local_world_size=per_node))
    steps = args.grad_accum_steps or (
        None if args.params is not None or not isinstance(micro, int) else
        max(1, config.global_batch_size // (world * micro)))
    estimates = estimate_memory(model_or_count, world_size=world, precision=precision,
                                optimizer_states=args.optimizer_states,
                                activation_bytes=activations, device_bytes=device_bytes,
                                ranks_per_node=per_node, grad_accum_steps=steps or 1)
    choice = choose_strategy(estimates, device_bytes=device_bytes, world_size=world,
                             ranks_per_node=per_node)
    where = f"{args.nodes} nodes x {per_node} ranks" if args.nodes > 1 else f"world size {world}"
    print(f"{label}, {precision}, {where}, K={steps or 1}, {device_bytes / 2**30:.1f} GiB per "
          "rank")
    print(format_table(estimates))
    trainable = (model_or_count if isinstance(model_or_count, int) else
                 sum(p.numel() for p in model_or_count.parameters() if p.requires_grad))
    print(reduction_line(trainable, reduce_dtype, world, steps))
    print(f"auto: {choice.reason}")
    return 0


def reduce_dtype_of(given: str | None, precision: str) -> str:
    """The reduction's dtype name: ``given`` (a ``reduce_dtype`` word), else the precision's.

    Raises:
        ConfigError: an unknown word, or fp16 where the precision scales no loss.
    """
    from accumix.precision.reduce_dtype import check_fp16_reduction, parse_reduce_dtype

    dtype = parse_reduce_dtype(given) or ("bfloat16" if precision == "bf16-true" else "float32")
    check_fp16_reduction(dtype, loss_scaled=precision == "fp16-mixed", precision=precision)
    return dtype


def reduction_line(trainable: int, reduce_dtype: str, world: int, grad_accum_steps: int | None
                   ) -> str:
    """The gradient reduction's bytes per optimizer step: one rank's payload."""
    from accumix.precision.reduce_dtype import reduction_bytes

    if world == 1:
        return "gradient reduction: none (one process)"
    once = reduction_bytes(trainable, reduce_dtype)
    each = (f"{grad_accum_steps} x that ({grad_accum_steps * once / 2**20:,.1f} MiB)"
            if grad_accum_steps else "K x that")
    return (f"gradient reduction in {reduce_dtype}: {once / 2**20:,.1f} MiB per rank per "
            f"optimizer step (ddp, zero1, fsdp, deepspeed stage 1: once per step; fsdp "
            f"sync_each_microstep and deepspeed stages 2-3 reduce every micro-step: {each})")


def _run_jax(args: argparse.Namespace, config: Any, devices: int, precision: str,
             reduce_dtype: str = "float32", grad_accum_steps: int | None = None) -> int:
    """The JAX backend's table (``accumix.jax.memory``): per device of a ``devices`` mesh, each
    device ``micro_batch_size`` rows (``accumix launch``: one device per process), K
    ``grad_accum_steps`` (default: the recipe's). The recipe's activations are measured: its
    window step compiled for one device (never run, nothing allocated),
    ``accumix.jax.compiled_memory``."""
    import optax

    from accumix.jax.memory import (
        device_free_bytes,
        estimate_jax_memory,
        format_jax_table,
        pick_strategy,
    )
    from accumix.recipes import default_jax, gpt_jax

    shape = config.model
    activations, window_bytes = 0, 0
    if args.params is not None:
        params: Any = _parse_count(args.params)
        optimizer = optax.adamw(1e-3) if args.optimizer_states == 2 else None
        label = f"{params:,} parameters in one leaf (activations not counted)"
    else:
        params = gpt_jax.init_params(shape, shapes_only=True)
        optimizer, _ = default_jax.optimizer_and_schedule(config, params, 1, 1)
        label = f"the recipe's GPT ({gpt_jax.num_parameters(shape):,} parameters"
        micro = config.micro_batch_size
        if micro == "auto":  # the choice accumix train makes here (per device), no training
            import dataclasses

            micro = _probe_jax_recipe(config, optimizer)
            config = dataclasses.replace(config, micro_batch_size=micro)
        if isinstance(micro, int):
            activations, how = _jax_activations(config, params, optimizer, devices, precision,
                                                grad_accum_steps)
            # hsdp's rows: fsdp's step over a node's devices; its activations are taken from
            # the fsdp rows of the whole mesh (measured alike: one device's rows each).
            activations.update({"hsdp": activations["fsdp-sync"],
                                "hsdp-defer": activations["fsdp"]})
            steps = grad_accum_steps or max(1, config.global_batch_size // (devices * micro))
            # The window as the step holds it: K micro-batches of every device's rows.
            window_bytes = devices * steps * 2 * micro * shape.block_size * 4
            label += (f", micro batch {micro} x {shape.block_size} tokens per device, K={steps};"
                      f" activations measured from XLA: memory_analysis() of {how})")
    device_bytes = (int(args.device_gib * 2**30) if args.device_gib is not None
                    else device_free_bytes())
    import jax

    estimates = estimate_jax_memory(params, optimizer, num_devices=devices, precision=precision,
                                    platform=jax.devices()[0].platform,
                                    optimizer_states=args.optimizer_states,
                                    window_bytes=window_bytes, activation_bytes=activations,
                                    replicas=args.nodes)
    _, reason = pick_strategy(estimates, device_bytes=device_bytes, nodes=args.nodes)
    where = f"{args.nodes} nodes x {devices // args.nodes} devices" if args.nodes > 1 else (
        f"{devices} devices")
    k = f", K={grad_accum_steps}" if grad_accum_steps and args.params is not None else ""
    print(f"{label}, {precision}, JAX, {where}{k}, {device_bytes / 2**30:.1f} GiB per device")
    print(format_jax_table(estimates, device_bytes=device_bytes))
    trainable = params if isinstance(params, int) else gpt_jax.num_parameters(shape)
    steps = grad_accum_steps or (
        None if args.params is not None or not isinstance(config.micro_batch_size, int) else
        max(1, config.global_batch_size // (devices * config.micro_batch_size)))
    if devices > 1:  # the JAX strategies' reduction (accumix.jax.wire), one device's payload
        from accumix.precision.reduce_dtype import reduction_bytes

        once = reduction_bytes(trainable, reduce_dtype) / 2**20
        each = f"{steps} x that ({steps * once:,.1f} MiB)" if steps else "K x that"
        print(f"gradient reduction in {reduce_dtype}: {once:,.1f} MiB per device per optimizer "
              f"step (every strategy once after the window; fsdp-sync's and hsdp's "
              f"reduce-scatter every micro-step: {each})")
    print(f"auto: {reason}")
    return 0


def _host_devices(count: int) -> None:
    """Lets JAX's CPU backend show ``count`` host devices, so that each strategy's step can be
    compiled on the world's mesh: only before JAX is loaded, and never over the user's own
    setting (it changes nothing on a GPU or TPU)."""
    import os
    import sys

    flags = os.environ.get("XLA_FLAGS", "")
    if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def _jax_activations(config: Any, params: Any, optimizer: Any, devices: int,
                     precision: str, grad_accum_steps: int | None = None
                     ) -> tuple[dict[str, int], str]:
    """Each row's activations per device from the recipe's compiled window step (lowered and
    compiled for shapes, never run): on ``devices`` devices where this process has them (a CPU
    gets them as host devices, set before JAX loads), else on one device for every row; K
    ``grad_accum_steps`` on every row (default: the recipe's, which ``single`` runs on the
    whole global batch)."""
    import jax

    from accumix.jax.compiled_memory import measured_activation_bytes, strategy_for_row
    from accumix.jax.memory import JAX_STRATEGIES
    from accumix.recipes import default_jax

    shape, micro = config.model, config.micro_batch_size
    every = jax.devices()
    own = len(every) >= devices
    out = {}
    for row in JAX_STRATEGIES:
        per = devices if own and row != "single" else 1
        steps = grad_accum_steps or max(1, config.global_batch_size // (devices * micro))
        if row == "single" and not grad_accum_steps:  # one device takes every device's rows
            steps = max(1, config.global_batch_size // micro)
        if not own and out:
            out[row] = out["single"]
            continue
        strategy = strategy_for_row(row, every[:per])
        out[row] = measured_activation_bytes(
            default_jax.make_loss_fn(shape), params, optimizer,
            default_jax.micro_batch_shapes(shape, micro), grad_accum_steps=steps,
            precision=precision, clip_norm=config.grad_clip, strategy=strategy)
    how = ("each strategy's compiled window step" if own else
           f"the compiled one-device window step (this process has {len(every)} of the "
           f"{devices} devices)")
    return out, how


def _probe_jax_recipe(config: Any, optimizer: Any) -> int:
    """``micro_batch_size=auto`` on JAX: the recipe's choice in this process (its devices: a
    CPU's host devices are the world size's), from the compiled window step as the training run
    makes it, said in the same line; returns the rows per device. Writes nothing."""
    import accumix.jax as axj
    from accumix.recipes import default_jax, gpt_jax

    default_jax.check_auto(config)
    acc = axj.Accelerator(strategy=config.strategy, precision=config.precision,
                          global_batch_size=config.global_batch_size, micro_batch_size="auto",
                          memory_limit=config.memory_limit, seed=config.seed)
    state = acc.setup(gpt_jax.init_params(config.model), optimizer)
    micro = default_jax.choose_micro_batch(acc, config, state, cache=False)
    choice = acc.micro_batch_choice
    assert choice is not None
    print(choice.describe())  # the command's output (the log line goes to stderr)
    return micro // acc.local_devices


def _probe_recipe(config: object, world: int) -> int:
    """``micro_batch_size=auto``: probes the recipe's model on this process's device as the
    training run does on each of ``world`` ranks: one process here, over this rank's share of the
    global batch (its candidates are the divisors of global / world); logs and prints the line
    the run would, for the world; writes nothing to the run directory. A sharding strategy is
    probed unsharded here (one process), which errs on the safe side."""
    import dataclasses

    import accumix as ax
    from accumix.common.micro_batch_search import candidates
    from accumix.recipes import default
    from accumix.recipes.gpt import GPT

    assert isinstance(config, default.TrainConfig)
    global_batch = config.global_batch_size
    candidates(global_batch, world)  # a global batch the ranks do not divide: one line
    acc = ax.Accelerator(strategy=config.strategy, precision=config.precision,
                         global_batch_size=global_batch // world, micro_batch_size="auto",
                         memory_limit=config.memory_limit, seed=config.seed)
    model = GPT(config.model)
    _, _, micro = default.choose_micro_batch(acc, config, model,
                                             default.new_optimizer(config, model), cache=False)
    choice = acc.micro_batch_choice
    assert choice is not None
    choice = dataclasses.replace(choice, dp_world_size=world, global_batch_size=global_batch,
                                 grad_accum_steps=global_batch // (world * micro))
    print(choice.describe())  # the command's output (the log line goes to stderr)
    acc.end()
    return micro
