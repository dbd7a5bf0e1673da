"""DeepSpeed's config from accumix's settings, with a user config merged and checked.

accumix owns the keys that carry its semantics (micro batch, K, ZeRO stage, precision blocks,
the fp16 loss scale, clipping); a user config may add any other DeepSpeed setting, and a value
that contradicts one of accumix's is a ``ConfigError`` naming every such key. Importing this
module does not import DeepSpeed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from accumix.errors import ConfigError
from accumix.precision import DynamicLossScale, Policy
from accumix.precision.policy import dtype_name

INSTALL_HINT = "pip install 'accumix[deepspeed]'"
_WORDS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # DeepSpeed's dtype words


def import_deepspeed() -> Any:
    """The ``deepspeed`` module, imported on first use (its import alone takes seconds).

    Raises:
        ConfigError: DeepSpeed is not installed.
    """
    try:
        import deepspeed
    except ImportError as exc:
        raise ConfigError(
            f"strategy='deepspeed' needs DeepSpeed, which is not installed ({exc}); "
            f"run: {INSTALL_HINT}"
        ) from exc
    return deepspeed


# -- the config ------------------------------------------------------------------------------
def fp16_block(loss_scale: DynamicLossScale) -> dict[str, Any]:
    """DeepSpeed's ``fp16`` block with the same dynamic loss scaling as ``loss_scale``.

    Overflows (hysteresis, backoff, the floor) follow DESIGN.md exactly. Growth differs by one
    step: DeepSpeed counts its stable interval from the step after an overflow (or the first
    step), so with ``loss_scale_window = growth_interval`` the scale doubles after
    ``growth_interval + 1`` clean steps and then every ``growth_interval``, where accumix's
    own scaler doubles after ``growth_interval``, ``2 * growth_interval``, ... DeepSpeed's
    scaler also only doubles and halves, starts at a power of two and has an integer floor.

    Raises:
        ConfigError: a setting DeepSpeed's scaler cannot express.
    """
    power = math.log2(loss_scale.init_scale)
    problems = []
    if loss_scale.growth_factor != 2.0 or loss_scale.backoff_factor != 0.5:
        problems.append(f"growth_factor={loss_scale.growth_factor}, backoff_factor="
                        f"{loss_scale.backoff_factor} (DeepSpeed doubles and halves: 2.0, 0.5)")
    if power != int(power):
        problems.append(f"init_scale={loss_scale.init_scale} (DeepSpeed needs a power of 2)")
    if loss_scale.min_scale != int(loss_scale.min_scale):
        problems.append(f"min_scale={loss_scale.min_scale} (DeepSpeed needs an integer)")
    if problems:
        raise ConfigError(
            f"DynamicLossScale({'; '.join(problems)}) cannot be expressed by DeepSpeed's loss "
            "scaler; change these settings or use strategy='ddp'/'fsdp'"
        )
    return {
        "enabled": True,
        "loss_scale": 0,  # 0: dynamic
        "initial_scale_power": int(power),
        "loss_scale_window": loss_scale.growth_interval,
        "hysteresis": loss_scale.hysteresis,
        "consecutive_hysteresis": False,
        "min_loss_scale": int(loss_scale.min_scale),
    }


def deepspeed_config(
    *,
    stage: int,
    grad_accum_steps: int,
    micro_batch_size: int | None,
    dp_world_size: int,
    policy: Policy,
    loss_scale: DynamicLossScale | None,
    user_config: dict[str, Any] | str | Path | None = None,
    hpz_partition_size: int | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config for accumix's settings, with the user's config merged in.

    Args:
        stage: ZeRO stage, 1, 2 or 3.
        grad_accum_steps: K; accumix marks each boundary itself, K is the engine's bookkeeping.
        micro_batch_size: samples per forward on one rank; None: 1 (DeepSpeed requires a value;
            only its sample counters and its own dataloader read it).
        dp_world_size: data-parallel ranks.
        policy: the precision; fp16 compute gives the fp16 block, bf16 the bf16 block; its
            ``reduce_dtype`` is ``communication_data_type`` (DeepSpeed's own default is the
            half dtype), and a half precision accumulates the window in float32
            (``data_types.grad_accum_dtype``; DeepSpeed's default, the half dtype, diverged in
            its #2768).
        loss_scale: the fp16 settings (None: ``DynamicLossScale()`` defaults).
        user_config: a dict or a JSON file path, merged over the defaults.
        hpz_partition_size: ZeRO++'s secondary partition (``DeepSpeedStrategy(hpz=)``).

    Returns:
        A new dict for ``deepspeed.initialize(config=...)``.

    Raises:
        ConfigError: the user config contradicts accumix's settings (every key is named), asks
            for something accumix drives itself (optimizer, scheduler) or cannot support
            (offload_optimizer), or is not a dict or readable JSON file.
    """
    if stage not in (1, 2, 3):
        raise ConfigError(f"DeepSpeedStrategy(stage={stage!r}) is invalid; use 1, 2 or 3")
    micro = micro_batch_size or 1
    half = policy.half_dtype
    fixed: dict[str, tuple[Any, str]] = {  # dotted key -> (value, where accumix got it)
        "train_micro_batch_size_per_gpu": (micro, "the micro batch size"),
        "gradient_accumulation_steps": (grad_accum_steps, "grad_accum_steps"),
        "train_batch_size": (micro * grad_accum_steps * dp_world_size,
                             "micro batch x grad_accum_steps x world"),
        "zero_optimization.stage": (stage, "DeepSpeedStrategy(stage=)"),
        "gradient_clipping": (0.0, "acc.clip_grad_norm_ (accumix clips)"),
        "fp16.enabled": (half == torch.float16, f"precision={policy.name!r}"),
        "bf16.enabled": (half == torch.bfloat16, f"precision={policy.name!r}"),
        "communication_data_type": (_WORDS[dtype_name(policy.reduce_dtype)],
                                    "reduce_dtype (the precision's by default)"),
    }
    if half is not None:
        fixed["data_types.grad_accum_dtype"] = ("fp32", "the window summed in float32")
    if hpz_partition_size is not None:
        fixed["zero_optimization.zero_hpz_partition_size"] = (hpz_partition_size,
                                                              "DeepSpeedStrategy(hpz=)")
    if half == torch.float16:
        for key, value in fp16_block(loss_scale or DynamicLossScale()).items():
            fixed.setdefault(f"fp16.{key}", (value, "loss_scale=DynamicLossScale(...)"))
    config: dict[str, Any] = {
        "wall_clock_breakdown": False,
        "steps_per_print": None,
    }
    for key, (value, _) in fixed.items():
        _set(config, key, value)
    user = read_user_config(user_config)
    clashes = [
        f"{key}={_get(user, key)!r} (accumix: {value!r} from {source})"
        for key, (value, source) in fixed.items()
        if _get(user, key) is not None and not _same(_get(user, key), value)
    ]
    for key, why in (("optimizer", "the optimizer passed to acc.setup is the client optimizer"),
                     ("scheduler", "acc.setup's LR scheduler steps with the real steps"),
                     ("zero_optimization.offload_optimizer",
                      "accumix rescales and clips the gradient partitions on the device")):
        if _get(user, key) not in (None, {}) and not (
                isinstance(_get(user, key), dict) and _get(user, key).get("device") == "none"):
            clashes.append(f"{key} ({why})")
    if clashes:
        raise ConfigError(
            f"the DeepSpeed config contradicts accumix's settings: {'; '.join(clashes)}; remove "
            "these keys from the config (or change the Accelerator's arguments)"
        )
    return _merge(config, user)


def read_user_config(user_config: dict[str, Any] | str | Path | None) -> dict[str, Any]:
    if user_config is None:
        return {}
    if isinstance(user_config, dict):
        return json.loads(json.dumps(user_config))  # a deep copy that is JSON like DeepSpeed's
    if isinstance(user_config, (str, Path)):
        try:
            loaded = json.loads(Path(user_config).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"DeepSpeed config {str(user_config)!r} is not a readable JSON file: {exc}"
            ) from exc
        if isinstance(loaded, dict):
            return loaded
    raise ConfigError(
        f"DeepSpeedStrategy(config={user_config!r}) is invalid; pass a dict or a JSON file path"
    )


def _get(config: dict[str, Any], dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _set(config: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        config = config.setdefault(part, {})
    config[last] = value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or (not isinstance(a, bool) and a in (0, 1) and bool(a) is b)
    return a == b


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out
