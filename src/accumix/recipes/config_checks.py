"""Checks of the recipe's values that need more than a comparison, before any process starts:
``init_from`` is a safetensors file (when the config is read), the model fits this machine
(``accumix train``, before it builds or launches anything; not in the config, which
``accumix estimate-memory`` also reads for models larger than this host).

Before them, a huge ``model.block_size`` failed inside torch's allocator and ``init_from=`` a
text file failed with a safetensors traceback on every rank. (``GPTConfig`` bounds the layers
and parameters themselves: ``model.n_layer=100000000000000000000000`` built blocks until the
machine ran out of memory.)
"""

from __future__ import annotations

from pathlib import Path

from accumix.common.hardware import host_memory_bytes
from accumix.errors import ConfigError
from accumix.recipes.gpt import GPTConfig

FLOAT32_BYTES = 4


def check_model_fits(model: GPTConfig, memory: int | None = None) -> None:
    """Refuses a GPT whose float32 weights alone exceed this host's memory (it could never be
    built; the recipe builds it on the host first).

    Args:
        model: the GPT's shape.
        memory: the host's bytes (default: ``host_memory_bytes()``; None: unknown, no check).

    Raises:
        ConfigError: naming the parameter count, the bytes and the host's memory.
    """
    memory = host_memory_bytes() if memory is None else memory
    if memory is None:
        return
    params = model.num_parameters()
    need = FLOAT32_BYTES * params
    if need > memory:
        raise ConfigError(
            f"model.* gives a GPT of {params:.3g} parameters ({need / 2**30:.3g} GiB in float32, "
            f"n_layer={model.n_layer}, n_embd={model.n_embd}, block_size={model.block_size}), "
            f"more than this machine's memory ({memory / 2**30:.3g} GiB); make model.n_layer, "
            "model.n_embd or model.block_size smaller")


def check_init_from(path: str) -> None:
    """Refuses an ``init_from`` that is not a readable safetensors file (reads its header only).

    Raises:
        ConfigError: a missing file, a directory, or not safetensors.
    """
    if not Path(path).is_file():
        raise ConfigError(f"init_from={path!r} is not a file; give a model.safetensors "
                          "written by accumix train")
    from safetensors import safe_open

    try:
        with safe_open(path, framework="numpy") as f:
            f.keys()
    except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError: one line either way
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"init_from={path!r} is not a safetensors file ({detail}); give a "
                          "model.safetensors written by accumix train (<run_dir>/"
                          "model.safetensors)") from None
