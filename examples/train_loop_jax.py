"""The JAX loop of JAX.md on real text: the byte-level GPT of examples/train_loop.py, on JAX.

    python examples/train_loop_jax.py                        # one process, all its devices
    accumix launch --nproc 2 examples/train_loop_jax.py      # two processes, unchanged

What differs from the torch loop: the model is a pure function of a params pytree
(``recipes/gpt_jax.py``, the same parameter names as the torch GPT); one jitted
``step(state, window)`` is a whole optimizer step over K micro-batches (there is no
``accumulate()`` / ``backward`` / ``optimizer.step()`` to call); the state is returned, not
mutated; documents are padded to ``block_size`` so the step compiles once; and the metrics
stay on the device until read.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import jax
import numpy as np
import optax
from torch.utils.data import DataLoader

import accumix.jax as axj
from accumix.recipes import ByteDocumentDataset, GPTConfig, gpt_jax, split_files, stdlib_files
from accumix.recipes.default import SampleConfig
from accumix.recipes.default_jax import generate, padded_collate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--val-bytes", type=int, default=100_000, help="held-out text to score")
    args = parser.parse_args()

    acc = axj.Accelerator(strategy="auto", precision=args.precision,
                          global_batch_size=args.global_batch,
                          micro_batch_size=args.micro_batch, seed=0)
    config = GPTConfig(block_size=128, n_layer=2, n_head=4, n_embd=128)
    train_files, val_files = split_files(stdlib_files(max_files=200), val_fraction=0.05)
    train = ByteDocumentDataset(train_files, config.block_size, max_bytes=2_000_000)
    val = ByteDocumentDataset(val_files, config.block_size, max_bytes=args.val_bytes)
    collate = partial(padded_collate, length=config.block_size, rows=args.micro_batch)
    loader = DataLoader(train, batch_size=args.micro_batch, shuffle=True, collate_fn=collate)
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, args.steps, 1e-4)
    optimizer = optax.adamw(schedule, weight_decay=0.1)
    state, windows = acc.setup(gpt_jax.init_params(config), optimizer, loader)

    def loss_fn(params, batch, rng):  # one device's rows: summed token loss, token count
        return gpt_jax.loss_sum(params, batch, config)

    step = acc.train_step(loss_fn, clip_norm=1.0)  # jitted once; the state is donated
    acc.print(f"{acc.world_size} process(es), {acc.num_devices} device(s), strategy "
              f"{acc.strategy.name}, precision {acc.policy.name}, K={acc.grad_accum_steps}, "
              f"{len(train)} training documents")

    started = time.perf_counter()
    steps_taken = 0
    while steps_taken < args.steps:
        for window in windows:                     # K micro-batches of this process
            state, metrics = step(state, window)   # one optimizer step, no host sync
            steps_taken += 1
            if steps_taken % 10 == 0:              # reading a metric waits for the device
                acc.print(f"step {int(state.step):4d}  loss/token {float(metrics['loss']):.3f}  "
                          f"grad norm {float(metrics['grad_norm']):.2f}  "
                          f"{time.perf_counter() - started:.0f}s")
            if steps_taken >= args.steps:
                break

    evaluate = acc.eval_step(loss_fn)
    total = [0.0, 0.0]
    for batch in DataLoader(val, batch_size=args.micro_batch, collate_fn=collate):
        batch = jax.tree.map(np.asarray, {k: v.numpy() for k, v in batch.items()})
        loss_sum, num_items = evaluate(state, batch)  # every process sees every document
        total = [total[0] + float(loss_sum), total[1] + float(num_items)]
    acc.print(f"validation loss/token {total[0] / total[1]:.3f} on {len(val)} documents")
    acc.print("sample:\n" + generate(state.params, config, SampleConfig(max_new_tokens=120)))


if __name__ == "__main__":
    main()
