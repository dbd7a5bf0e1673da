"""The default recipe on JAX (``accumix train backend=jax``): the same GPT, data and outputs.

The model is ``recipes/gpt_jax.py`` (plain JAX, the torch GPT's parameter names and layout);
the data, the config, the Trainer's loop, the loggers, the progress line, the LR schedule, the
plot and the closing report are the torch recipe's own. What differs is only the step: one
jitted call per window through ``accumix.jax`` (``JaxSteps``), documents padded to
``block_size`` so the step compiles once, and metrics read from the device every few steps.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from accumix.common.micro_batch_search import candidates
from accumix.common.safe_write import replace_with
from accumix.errors import ConfigError
from accumix.recipes import gpt_jax
from accumix.recipes.default import (
    MODEL_FILE,
    SampleConfig,
    TrainConfig,
    datasets,
    report,
    total_steps,
)
from accumix.recipes.gpt import IGNORE_INDEX, GPTConfig
from accumix.recipes.text_data import (
    decode,
    encode,
    pad_collate,
)
from accumix.recipes.tracking import SaveModelAtEnd, tracking_options


def padded_collate(batch: list[torch.Tensor], *, length: int, rows: int) -> dict[str, Any]:
    """``pad_collate`` to ``length`` positions and ``rows`` rows: static shapes for the jitted
    step; added rows have no labels (-100), so they change no sum."""
    out = pad_collate(batch, length=length)
    missing = rows - out["input_ids"].shape[0]
    if missing > 0:
        out = {"input_ids": torch.cat([out["input_ids"],
                                       torch.zeros(missing, length, dtype=torch.int64)]),
               "labels": torch.cat([out["labels"],
                                    torch.full((missing, length), IGNORE_INDEX)])}
    return out


def optimizer_and_schedule(config: TrainConfig, params: Any, total_steps: int,
                           global_batch_size: int) -> tuple[Any, Any]:
    """AdamW with the torch recipe's settings and schedule (``WarmupDecay``, tabulated so both
    backends use the very same numbers), decay on matrices only."""
    import jax
    import jax.numpy as jnp
    import optax

    from accumix.trainer import WarmupDecay, scale_lr

    opt = config.optimizer
    lr = opt.lr
    if opt.base_batch_size is not None:
        lr = scale_lr(lr, global_batch_size=global_batch_size,
                      base_batch_size=opt.base_batch_size, rule=opt.scale_rule)
    decay = WarmupDecay(warmup_steps=min(opt.warmup_steps, total_steps), total_steps=total_steps,
                        decay=opt.decay, min_ratio=opt.min_lr_ratio)
    table = np.asarray([lr * decay(step) for step in range(total_steps + 1)], np.float32)

    def schedule(count: Any) -> Any:
        return jnp.asarray(table)[jnp.minimum(count, total_steps)]

    mask = jax.tree.map(lambda p: np.ndim(p) >= 2, params)  # nanoGPT's split, as on torch
    tx = optax.adamw(schedule, b1=opt.betas[0], b2=opt.betas[1], eps=1e-8,
                     weight_decay=opt.weight_decay, mask=mask)
    return tx, (lambda step: float(table[min(step, total_steps)]))


def make_loss_fn(model: GPTConfig) -> Any:
    """The recipe's ``loss_fn(params, batch, rng)``: summed token loss and the token count."""
    def loss_fn(p: Any, batch: Any, rng: Any) -> Any:
        return gpt_jax.loss_sum(p, batch, model, rng if model.dropout else None)
    return loss_fn


def micro_batch_shapes(model: GPTConfig, rows: int) -> dict[str, Any]:
    """One device's micro-batch as the loader gives it (``padded_collate``: ``block_size``
    positions, int32 once in JAX), as shapes."""
    import jax

    spec = jax.ShapeDtypeStruct((rows, model.block_size), np.int32)
    return {"input_ids": spec, "labels": spec}


def initial_params(config: TrainConfig) -> dict[str, Any]:
    """The torch recipe's initial weights, or ``init_from``'s (either backend's
    ``model.safetensors``).

    Raises:
        ConfigError: the file does not fit the model's shape.
    """
    if config.init_from is None:
        # The torch recipe's very weights (its GPT drawn right after seeding), so one job gives
        # the same losses on either backend; gpt_jax.init_params is the torch-free init.
        from accumix.recipes.gpt import GPT

        torch.manual_seed(config.seed)
        model = GPT(config.model)
        return gpt_jax.from_torch_keys(
            {k: v.detach().numpy() for k, v in model.state_dict().items()}, config.model)
    from safetensors.numpy import load_file

    try:
        return gpt_jax.from_torch_keys(load_file(config.init_from), config.model)
    except ValueError as exc:
        raise ConfigError(f"init_from={config.init_from!r}: {exc}") from exc


def worst_batch(model: GPTConfig, rows: int) -> dict[str, Any]:
    """``rows`` documents of ``block_size`` tokens, as the loader gives them: the longest the
    data can produce, so the batch ``micro_batch_size=auto`` probes with."""
    full = [torch.zeros(model.block_size + 1, dtype=torch.int64)]
    return padded_collate(full * rows, length=model.block_size, rows=rows)


def check_auto(config: TrainConfig) -> None:
    """Refuses ``micro_batch_size=auto`` where the probe would have no limit to fit under,
    before anything is set up.

    Raises:
        ConfigError: the device reports no memory size and no ``memory_limit`` is given.
    """
    from accumix.jax.micro_batch import device_total_bytes

    if config.memory_limit is None and device_total_bytes() is None:
        raise ConfigError("micro_batch_size=auto: this device (backend=jax) reports no memory "
                          "size; pass memory_limit= in bytes, e.g. memory_limit=2000000000")


def choose_micro_batch(acc: Any, config: TrainConfig, state: Any, *, cache: bool = True) -> int:
    """``micro_batch_size=auto``: the largest micro batch whose compiled window step fits
    ``memory_limit`` with ``block_size``-token rows (the longest the data gives), agreed by
    every process, said in one line; cached in the run directory when ``cache``."""
    check_auto(config)
    return acc.find_micro_batch_size(state, make_loss_fn(config.model),
                                     partial(worst_batch, config.model),
                                     clip_norm=config.grad_clip,
                                     run_dir=config.run_dir if cache else None)


def set_up(acc: Any, config: TrainConfig, params: Any, documents: int) -> tuple[Any, int, Any]:
    """The set-up state, the micro batch and the LR table's reader.

    Under ``micro_batch_size=auto`` the state is set up first and the micro batch chosen from
    its compiled window step (``choose_micro_batch``), cached in the run directory; the probe
    only compiles, so the state is the one an explicit run starts from.
    """
    global_batch, world = config.global_batch_size, acc.world_size
    micro = config.micro_batch_size
    if micro == "auto":
        check_auto(config)  # before the setup's lines, so the error is the only one
        candidates(global_batch, world)  # a global batch the processes do not divide
    # The schedule's length does not depend on the micro batch: an epoch's windows are
    # ceil(ceil(documents / world) / micro) / K rounded up = ceil(ceil(documents / world) /
    # (global / world)), so a schedule built before the choice is the explicit run's.
    total = total_steps(config, documents, world, global_batch // world, 1)
    tx, lr_at = optimizer_and_schedule(config, params, total, global_batch)
    state = acc.setup(params, tx)
    if micro == "auto":
        micro = choose_micro_batch(acc, config, state)
    return state, micro, lr_at


def run(config: TrainConfig) -> int:
    """Trains the recipe with accumix.jax on the processes this one was launched with."""
    import accumix.jax as axj
    from accumix.trainer import ThroughputMonitor, Trainer
    from accumix.trainer.jax_steps import JaxSteps

    started = time.perf_counter()
    acc = axj.Accelerator(strategy=config.strategy, precision=config.precision,
                          global_batch_size=config.global_batch_size,
                          micro_batch_size=config.micro_batch_size, seed=config.seed,
                          memory_limit=config.memory_limit, reduce_dtype=config.reduce_dtype)
    train_files, val_files, train, val = datasets(config)
    model_cfg = config.model
    loss_fn = make_loss_fn(model_cfg)
    params = initial_params(config)
    state, micro, lr_at = set_up(acc, config, params, len(train))
    collate = partial(padded_collate, length=model_cfg.block_size, rows=micro)
    windows = acc.setup_loader(DataLoader(train, batch_size=micro, shuffle=True,
                                          collate_fn=collate))
    steps = JaxSteps(accelerator=acc, state=state, train_windows=windows, loss_fn=loss_fn,
                     val_loader=DataLoader(val, batch_size=micro, collate_fn=collate),
                     lr=lr_at)
    trainer = Trainer(
        steps=steps, max_steps=config.max_steps, max_epochs=config.max_epochs,
        eval_every=config.eval_every, checkpoint_every=config.checkpoint_every,
        **config.trainer_dirs(), resume=config.resume, grad_clip=config.grad_clip,
        progress_bar=config.progress_bar,
        preemption_signals=config.preemption_signals, requeue=config.requeue,
        callbacks=[ThroughputMonitor(flops_per_item=gpt_jax.flops_per_token(model_cfg)),
                   SaveModelAtEnd(lambda: save_weights(acc, steps.state, config.run_dir,
                                                       model_cfg))],
        **tracking_options(config),
    )
    num_params = gpt_jax.num_parameters(model_cfg)
    acc.print(
        f"accumix train (jax): {num_params / 1e6:.1f}M-parameter GPT on {len(train_files)} "
        f"files ({train.num_targets / 1e6:.1f}M training bytes in {len(train)} documents; "
        f"{len(val_files)} files held out)\n"
        f"  {acc.world_size} process(es) x {acc.local_devices} device(s), strategy "
        f"{acc.strategy.name}, precision {acc.policy.name}, global batch "
        f"{config.global_batch_size} = micro batch {micro} x "
        f"{acc.world_size} process(es) x K={acc.grad_accum_steps}; run directory "
        f"{config.run_dir}", flush=True)
    result = trainer.fit()  # SaveModelAtEnd wrote model.safetensors
    report(acc, config, result, num_val=len(val), started=started)
    if config.sample.max_new_tokens > 0:
        text = generate(steps.state.params, model_cfg, config.sample, seed=config.seed)
        acc.print("sample:\n" + text, flush=True)
    return 0


def save_weights(acc: Any, state: Any, run_dir: Path, model: GPTConfig) -> Path:
    """``run_dir/model.safetensors`` with the torch GPT's keys (the tied head included), so
    ``accumix train init_from=...`` loads it on either backend. Collective."""
    import jax
    from jax.experimental import multihost_utils
    from safetensors.numpy import save_file

    full = jax.tree.map(lambda x: multihost_utils.process_allgather(x, tiled=True), state.params)
    path = run_dir / MODEL_FILE
    if acc.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        flat = gpt_jax.to_torch_keys(full, model)
        tensors = {k: np.ascontiguousarray(v) for k, v in flat.items()}
        replace_with(path, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    return path


def generate(params: Any, model: GPTConfig, sample: SampleConfig, *, seed: int = 0) -> str:
    """Continues ``sample.prompt`` (temperature, top-k), reproducibly; every process alike."""
    import jax
    import jax.numpy as jnp

    block = model.block_size
    prompt = encode(sample.prompt).numpy().astype(np.int32)
    tokens = np.zeros(block, np.int32)
    count = min(len(prompt), block)
    tokens[:count] = prompt[-count:]
    out = list(prompt)

    @jax.jit
    def next_token(p: Any, ids: jax.Array, position: jax.Array, key: jax.Array) -> jax.Array:
        logits = gpt_jax.logits(p, ids[None], model)[0, position].astype(jnp.float32)
        if sample.temperature <= 0:
            return jnp.argmax(logits)
        logits = logits / sample.temperature
        if sample.top_k is not None:
            kth = jax.lax.top_k(logits, min(sample.top_k, logits.shape[-1]))[0][-1]
            logits = jnp.where(logits < kth, -jnp.inf, logits)
        return jax.random.categorical(key, logits)

    key = jax.random.key(seed)
    for i in range(sample.max_new_tokens):
        if count == block:  # slide: keep the last block_size - 1 tokens
            tokens[:-1], count = tokens[1:].copy(), block - 1
        chosen = next_token(params, jnp.asarray(tokens), count - 1, jax.random.fold_in(key, i))
        token = int(np.asarray(chosen.addressable_data(0)))
        tokens[count] = token
        count += 1
        out.append(token)
    return decode(out)
