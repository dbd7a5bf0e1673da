"""What ``strategy="auto"`` sizes on the flax GPT (issue 30, item 4), against the step it runs.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/scripts/jax_auto_sizing.py 8

For each of ddp, zero1, fsdp and fsdp-sync on this process's devices (fp32, Adam, K=4, 2 rows
per device): the model without activations (``estimate_jax_memory``, what ``auto`` used
before), the row ``auto`` sizes with ``acc.setup(..., loss_fn=, batch=)``
(``compiled_memory.sizing``), and arguments + temporaries of the step ``acc.train_step``
compiles. Prints one JSON object ``{row: {"model": bytes, "sized": bytes, "measured": bytes}}``.
"""

from __future__ import annotations

import json
import sys
import warnings

import jax
import optax

import accumix.jax as axj
from accumix.jax import compiled_memory
from accumix.jax.memory import estimate_jax_memory
from tests.scripts import jax_fsdp_memory as job
from tests.scripts import jax_gpt as gpt


def main(argv: list[str]) -> None:
    warnings.simplefilter("ignore")
    layers = int(argv[0]) if argv else 8
    params, loss_fn, tx = gpt.init_params(layers), gpt.make_loss(layers), optax.adam(1e-3)
    devices, k = len(jax.devices()), job.GPT_K
    batch = gpt.micro_batch(job.GPT_ROWS * devices)  # this process's rows of one micro-step
    window_bytes = k * sum(x.nbytes for x in batch.values())
    model = {e.strategy: e.total_bytes for e in estimate_jax_memory(
        params, tx, num_devices=devices, window_bytes=window_bytes)}
    sized = compiled_memory.sizing(loss_fn, params, tx, batch, grad_accum_steps=k,
                                   precision="fp32")
    out = {}
    for row in ("ddp", "zero1", "fsdp", "fsdp-sync"):
        acc = axj.Accelerator(strategy=job.strategy(row), precision="fp32", grad_accum_steps=k)
        state = acc.setup(params, tx)
        stats = acc.train_step(loss_fn).lower(state, acc.window([batch] * k)).compile()
        stats = stats.memory_analysis()
        out[row] = {"model": int(model[row]), "sized": int(sized(row).total_bytes),
                    "measured": int(stats.argument_size_in_bytes + stats.temp_size_in_bytes)}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
