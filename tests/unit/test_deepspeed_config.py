"""DeepSpeed's config from accumix's settings: the mapping, the merge, the contradictions.

No processes and no DeepSpeed import: the config module is plain Python.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import accumix as ax
from accumix.precision import resolve_policy
from accumix.strategies import deepspeed_config as dsc

CPU = __import__("torch").device("cpu")
FP32 = resolve_policy("fp32", CPU)
BF16 = resolve_policy("bf16-mixed", CPU)


def _fp16():
    with pytest.warns(UserWarning):  # emulated on a CPU
        return resolve_policy("fp16-mixed", CPU)


def _config(**overrides):
    kwargs = dict(stage=2, grad_accum_steps=4, micro_batch_size=8, dp_world_size=2,
                  policy=FP32, loss_scale=None, user_config=None)
    kwargs.update(overrides)
    return dsc.deepspeed_config(**kwargs)


def test_accumix_settings_become_the_config() -> None:
    config = _config()
    assert config["train_micro_batch_size_per_gpu"] == 8
    assert config["gradient_accumulation_steps"] == 4
    assert config["train_batch_size"] == 8 * 4 * 2
    assert config["zero_optimization"] == {"stage": 2}
    assert config["gradient_clipping"] == 0.0  # accumix clips
    assert config["fp16"] == {"enabled": False} and config["bf16"] == {"enabled": False}
    # Set at setup, and only for an element-wise optimizer (optimizer_exactness).
    assert "zero_allow_untested_optimizer" not in config
    assert config["wall_clock_breakdown"] is False
    # DeepSpeed requires a micro batch; unknown -> 1 (only its counters read it).
    unknown = _config(micro_batch_size=None, grad_accum_steps=3, dp_world_size=4)
    assert unknown["train_micro_batch_size_per_gpu"] == 1 and unknown["train_batch_size"] == 12


def test_fp16_block_maps_the_dynamic_loss_scale() -> None:
    scale = ax.DynamicLossScale(init_scale=2.0**12, growth_interval=500, hysteresis=3,
                                min_scale=2.0)
    config = _config(policy=_fp16(), loss_scale=scale)
    assert config["fp16"] == {
        "enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
        "hysteresis": 3, "consecutive_hysteresis": False, "min_loss_scale": 2,
    }
    assert config["bf16"] == {"enabled": False}
    defaults = _config(policy=_fp16())["fp16"]  # None: DynamicLossScale()'s defaults
    assert (defaults["initial_scale_power"], defaults["loss_scale_window"],
            defaults["hysteresis"], defaults["min_loss_scale"]) == (16, 1000, 2, 1)


def test_bf16_block() -> None:
    config = _config(policy=BF16)
    assert config["bf16"] == {"enabled": True} and config["fp16"] == {"enabled": False}


def test_loss_scales_deepspeed_cannot_express() -> None:
    for kwargs, named in (
        ({"growth_factor": 4.0}, "growth_factor=4.0"),
        ({"backoff_factor": 0.25}, "backoff_factor=0.25"),
        ({"init_scale": 1000.0}, "init_scale=1000.0"),
        ({"min_scale": 0.5}, "min_scale=0.5"),
    ):
        with pytest.raises(ax.ConfigError, match=named):
            dsc.fp16_block(ax.DynamicLossScale(**kwargs))


def test_user_config_is_merged() -> None:
    user = {"zero_optimization": {"reduce_bucket_size": 1000, "stage": 2},
            "steps_per_print": 5, "gradient_accumulation_steps": 4, "fp16": {"enabled": False}}
    config = _config(user_config=user)
    assert config["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 1000}
    assert config["steps_per_print"] == 5
    assert user["zero_optimization"] == {"reduce_bucket_size": 1000, "stage": 2}  # not mutated
    # allowed: a device "none" offload block is no offload
    _config(user_config={"zero_optimization": {"offload_optimizer": {"device": "none"}}})


def test_user_config_from_a_json_file(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"overlap_comm": False}}))
    for given in (path, str(path)):
        config = _config(user_config=given)
        assert config["zero_optimization"] == {"stage": 2, "overlap_comm": False}
    with pytest.raises(ax.ConfigError, match="not a readable JSON file"):
        _config(user_config=tmp_path / "missing.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ax.ConfigError, match="pass a dict or a JSON file path"):
        _config(user_config=tmp_path / "list.json")


def test_contradictions_name_every_key() -> None:
    user = {"gradient_accumulation_steps": 8, "zero_optimization": {"stage": 3},
            "fp16": {"enabled": True}, "gradient_clipping": 1.0,
            "train_micro_batch_size_per_gpu": 8}
    with pytest.raises(ax.ConfigError) as err:
        _config(user_config=user)
    message = str(err.value)
    for key in ("gradient_accumulation_steps=8", "zero_optimization.stage=3",
                "fp16.enabled=True", "gradient_clipping=1.0"):
        assert key in message, message
    assert "train_micro_batch_size_per_gpu" not in message  # same value: no clash
    with pytest.raises(ax.ConfigError, match="fp16.hysteresis=5"):
        _config(policy=_fp16(), user_config={"fp16": {"hysteresis": 5}})


@pytest.mark.parametrize("user, key", [
    ({"optimizer": {"type": "Adam"}}, "optimizer"),
    ({"scheduler": {"type": "WarmupLR"}}, "scheduler"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.offload_optimizer"),
])
def test_blocks_accumix_drives_itself(user: dict, key: str) -> None:
    with pytest.raises(ax.ConfigError, match=key):
        _config(user_config=user)


def test_bad_stage_and_config_fail_at_construction() -> None:
    for stage in (0, 4, True):
        with pytest.raises(ax.ConfigError, match="use 1, 2 or 3"):
            ax.DeepSpeedStrategy(stage=stage)
    with pytest.raises(ax.ConfigError, match="pass a dict or a JSON file path"):
        ax.DeepSpeedStrategy(config=42)  # type: ignore[arg-type]


def test_missing_deepspeed_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` -> ImportError
    with pytest.raises(ax.ConfigError, match=r"pip install 'accumix\[deepspeed\]'"):
        dsc.import_deepspeed()
    with pytest.raises(ax.ConfigError, match=r"pip install 'accumix\[deepspeed\]'"):
        ax.DeepSpeedStrategy()
    with pytest.raises(ax.ConfigError, match=r"pip install 'accumix\[deepspeed\]'"):
        ax.Accelerator(strategy="deepspeed")


def test_importing_accumix_does_not_import_deepspeed() -> None:
    code = ("import sys, accumix as ax; ax.DeepSpeedStrategy; "
            "assert 'deepspeed' not in sys.modules, 'deepspeed imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_refusal_under_deepspeed_says_what_the_readme_says() -> None:
    """An optimizer accumix does not know was said to be exact under zero1, where the README
    says such optimizers run unchecked (issue 29)."""
    import torch

    from accumix.strategies.optimizer_exactness import check_deepspeed

    class Custom(torch.optim.Optimizer):
        def __init__(self, params: object) -> None:
            super().__init__(params, {"lr": 0.1})

    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ax.ConfigError) as unknown:
        check_deepspeed(Custom(params), False)
    assert ("use strategy='ddp', where any optimizer is exact (or 'zero1' if Custom's update "
            "reads only its own parameter: zero1 does not check it)") in str(unknown.value)
    with pytest.raises(ax.ConfigError) as adafactor:
        check_deepspeed(torch.optim.Adafactor(params), False)
    assert "use strategy='zero1' or 'ddp', where Adafactor is exact" in str(adafactor.value)
    with pytest.raises(ax.ConfigError) as lbfgs:  # exact under fsdp too since issue 38
        check_deepspeed(torch.optim.LBFGS(params), False)
    assert "use strategy='ddp' or 'fsdp', where LBFGS is exact" in str(lbfgs.value)
    check_deepspeed(torch.optim.SGD(params, lr=0.1), False)  # element-wise: accepted
    check_deepspeed(Custom(params), True)  # the user's config accepts the difference
