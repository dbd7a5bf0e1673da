"""Issue 33 in one process: the ``reduce_dtype`` words, the refusals (one line each), the
effective dtypes each strategy states, DeepSpeed's config, the recipe's key, estimate-memory's
bytes. The collectives themselves: ``tests/distributed/test_reduce_dtype*.py``."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import accumix as ax
from accumix.common.launch_env import LaunchEnv
from accumix.precision import NoLossScale, resolve_policy
from accumix.precision.policy import with_reduce_dtype
from accumix.precision.reduce_dtype import (
    EffectiveDtypes,
    parse_reduce_dtype,
    reduction_bytes,
)
from accumix.strategies import deepspeed_config as dsc

CPU = torch.device("cpu")
TWO_RANKS = LaunchEnv(rank=0, world_size=2, local_world_size=2)


def _policy(precision: str, reduce_dtype: str | None = None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # half precisions are emulated on a CPU
        return with_reduce_dtype(resolve_policy(precision, CPU), reduce_dtype)


def _connected(strategy, precision: str, reduce_dtype: str | None = None,
               launch: LaunchEnv = TWO_RANKS):
    """``strategy`` connected as the Accelerator does in a world of 2 (no process group: the
    connection itself communicates nothing)."""
    policy = _policy(precision, reduce_dtype)
    scaler = ax.DynamicLossScale() if policy.needs_loss_scaling else NoLossScale()
    strategy.connect(launch=launch, device=CPU, policy=policy, scaler=scaler)
    return strategy


@pytest.mark.parametrize(("given", "name"), [
    ("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16"), ("bfloat16", "bfloat16"),
    (torch.bfloat16, "bfloat16"), (torch.float16, "float16"), (None, None)])
def test_words_and_dtypes(given, name) -> None:
    assert parse_reduce_dtype(given) == name


@pytest.mark.parametrize("given", ["int8", "half", 16, torch.float64])
def test_an_unknown_reduce_dtype_is_one_line(given) -> None:
    with pytest.raises(ax.ConfigError) as err:
        parse_reduce_dtype(given)
    assert "\n" not in str(err.value) and "'fp32', 'bf16', 'fp16'" in str(err.value)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "bf16-true"])
def test_fp16_reduction_without_loss_scaling_is_refused_in_one_line(precision: str) -> None:
    with pytest.raises(ax.ConfigError) as err:
        ax.Accelerator(strategy="single", precision=precision, reduce_dtype="fp16")
    message = str(err.value)
    assert "\n" not in message and "reduce_dtype='fp16'" in message, message
    assert "reduce_dtype='bf16'" in message and precision in message, message


def test_the_cli_refuses_it_with_exit_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    from accumix.cli.main import main

    code = main(["estimate-memory", "--params", "1e6", "--world-size", "2", "--precision",
                 "fp32", "--reduce-dtype", "fp16", "--device-gib", "8"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "reduce_dtype='fp16'" in err[0], err


def test_a_strategy_reduce_dtype_contradicting_the_accelerators_is_refused() -> None:
    with pytest.raises(ax.ConfigError, match="contradicts the strategy's own"):
        ax.Accelerator(strategy=ax.FSDPStrategy(reduce_dtype=torch.float32), precision="fp32",
                       reduce_dtype="bf16")
    acc = ax.Accelerator(strategy=ax.FSDPStrategy(reduce_dtype=torch.bfloat16),
                         precision="fp32", reduce_dtype="bf16")
    assert acc.policy.reduce_dtype == torch.bfloat16


def test_a_strategy_that_would_ignore_it_refuses_it() -> None:
    class Plain(ax.Strategy):  # reduces gradients as they are (no honours_reduce_dtype)
        name = "plain"

    with pytest.raises(ax.ConfigError, match="reduces gradients in their own dtype") as err:
        _connected(Plain(), "fp32", "bf16")
    assert "\n" not in str(err.value)
    _connected(Plain(), "fp32", "fp32")  # its own dtype is fine
    _connected(Plain(), "fp32", "bf16", launch=LaunchEnv())  # one process reduces nothing


def test_effective_dtypes_per_strategy() -> None:
    single = ax.Accelerator(strategy="single", precision="bf16-mixed", reduce_dtype="bf16")
    assert single.effective_dtypes == EffectiveDtypes(
        params="float32", compute="bfloat16", accumulation="float32", reduction="none",
        masters="float32")
    assert single.policy.reduce_dtype == torch.bfloat16
    ddp = _connected(ax.DDPStrategy(), "bf16-mixed", "bf16").effective_dtypes()
    assert ddp.describe() == (
        "effective dtypes: params float32, compute bfloat16, gradient accumulation float32, "
        "reduction bfloat16 (once per optimizer step), optimizer masters float32")
    true = _connected(ax.DDPStrategy(), "bf16-true").effective_dtypes()
    assert (true.accumulation, true.reduction, true.masters) == ("bfloat16",) * 3
    # fsdp sums the window in the stored float32 whatever the wire; bf16-true with a float32
    # reduction upcasts the window (FSDP2's own reduce_dtype path).
    fsdp = _connected(ax.FSDPStrategy(), "bf16-mixed", "bf16").effective_dtypes()
    assert (fsdp.accumulation, fsdp.reduction, fsdp.reductions) == (
        "float32", "bfloat16", "once per optimizer step")
    up = _connected(ax.FSDPStrategy(), "bf16-true", "fp32").effective_dtypes()
    assert (up.params, up.accumulation, up.reduction) == ("bfloat16", "float32", "float32")
    each = _connected(ax.FSDPStrategy(sync_each_microstep=True), "fp32", "bf16")
    assert each.effective_dtypes().reductions == "every micro-step: sync_each_microstep"
    assert ddp.as_params()["dtype_reduction"] == "bfloat16"
    assert set(ddp.as_params()) == {"dtype_params", "dtype_compute", "dtype_accumulation",
                                    "dtype_reduction", "dtype_masters", "dtype_reductions"}


def _ds_config(policy, user=None):
    return dsc.deepspeed_config(stage=1, grad_accum_steps=4, micro_batch_size=8,
                                dp_world_size=2, policy=policy, loss_scale=None,
                                user_config=user)


def test_deepspeed_communicates_and_accumulates_as_told() -> None:
    # DeepSpeed's defaults were the half dtype for both (its #3370, #2768): now explicit.
    mixed = _ds_config(_policy("bf16-mixed"))
    assert mixed["communication_data_type"] == "fp32"
    assert mixed["data_types"] == {"grad_accum_dtype": "fp32"}
    assert _ds_config(_policy("bf16-mixed", "bf16"))["communication_data_type"] == "bf16"
    assert _ds_config(_policy("fp16-mixed", "fp16"))["communication_data_type"] == "fp16"
    plain = _ds_config(_policy("fp32"))
    assert plain["communication_data_type"] == "fp32" and "data_types" not in plain
    with pytest.raises(ax.ConfigError, match="communication_data_type='fp16'"):
        _ds_config(_policy("bf16-mixed", "bf16"), {"communication_data_type": "fp16"})
    with pytest.raises(ax.ConfigError, match="data_types.grad_accum_dtype='bf16'"):
        _ds_config(_policy("bf16-mixed"), {"data_types": {"grad_accum_dtype": "bf16"}})


def test_the_recipe_key(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """``reduce_dtype`` in a YAML file and as an ``accumix train`` override; a bad value is one
    line and exit status 2 before any rank starts. (The key reaching the Accelerator and the
    trackers: ``tests/distributed/test_trackers.py``.)"""
    from accumix.cli.main import main
    from accumix.recipes.train_config import TrainConfig
    from accumix.trainer.config import load_config

    assert TrainConfig(reduce_dtype="bf16").reduce_dtype == "bf16"
    assert TrainConfig().reduce_dtype is None
    # The JAX backend takes it too (was refused before accumix.jax honoured it, issue 33).
    assert TrainConfig(reduce_dtype="bf16", backend="jax").reduce_dtype == "bf16"
    assert dataclasses.replace(TrainConfig(), reduce_dtype="fp16").reduce_dtype == "fp16"
    (tmp_path / "job.yaml").write_text("reduce_dtype: bf16\nprecision: fp16-mixed\n")
    assert load_config(TrainConfig, tmp_path / "job.yaml").reduce_dtype == "bf16"
    assert load_config(TrainConfig, tmp_path / "job.yaml",
                       ["reduce_dtype=fp16"]).reduce_dtype == "fp16"
    assert load_config(TrainConfig, tmp_path / "job.yaml",
                       ["reduce_dtype=null"]).reduce_dtype is None
    assert main(["train", str(tmp_path / "job.yaml"), "--print-config"]) == 0
    assert "reduce_dtype: bf16\n" in capsys.readouterr().out
    for items, message in (
            (["reduce_dtype=int8"], "reduce_dtype='int8' is invalid; use fp32, bf16, fp16 or "
                                    "null (the precision's)"),
            (["reduce_dtype=16"], "reduce_dtype='16' is invalid"),
            (["reduce_dtype=fp16", "precision=bf16-mixed"],
             "reduce_dtype='fp16' needs loss scaling")):
        assert main(["train", *items, "--print-config"]) == 2, items
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (items, err)


def test_estimate_memory_states_the_reduction_bytes() -> None:
    from accumix.cli.estimate_memory import reduce_dtype_of, reduction_line

    assert reduction_bytes(1_000, "bfloat16") == 2_000
    assert reduction_bytes(1_000, "float32", reductions_per_step=4) == 16_000
    line = reduction_line(2**20, reduce_dtype_of("bf16", "fp32"), world=4, grad_accum_steps=8)
    assert line.startswith("gradient reduction in bfloat16: 2.0 MiB per rank per optimizer "
                           "step"), line
    assert "8 x that (16.0 MiB)" in line
    assert reduce_dtype_of(None, "bf16-mixed") == "float32"
    assert reduce_dtype_of(None, "bf16-true") == "bfloat16"
    assert reduction_line(2**20, "bfloat16", 1, 8) == "gradient reduction: none (one process)"


def test_estimate_memory_reads_the_recipe_key(capsys: pytest.CaptureFixture[str]) -> None:
    """The recipe's ``reduce_dtype`` (an override, as for ``accumix train``); ``--reduce-dtype``
    wins over it."""
    from accumix.cli.main import main
    from accumix.recipes.gpt import GPT, GPTConfig

    model = ["model.n_layer=1", "model.n_embd=64", "model.n_head=2"]
    options = ["--world-size", "2", "--precision", "fp32", "--device-gib", "8"]
    with torch.device("meta"):
        trainable = sum(p.numel() for p in GPT(GPTConfig(
            block_size=128, n_layer=1, n_head=2, n_embd=64)).parameters() if p.requires_grad)
    bf16 = ["reduce_dtype=bf16"]
    for key, flag, dtype, size in (([], [], "float32", 4), (bf16, [], "bfloat16", 2),
                                   (bf16, ["--reduce-dtype", "fp32"], "float32", 4)):
        assert main(["estimate-memory", *model, *key, *options, *flag]) == 0, (key, flag)
        line = next(x for x in capsys.readouterr().out.splitlines()
                    if x.startswith("gradient reduction"))
        assert line.startswith(f"gradient reduction in {dtype}: "
                               f"{trainable * size / 2**20:,.1f} MiB per rank"), (key, line)
    assert main(["estimate-memory", *model, "reduce_dtype=fp16", *options]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "reduce_dtype='fp16' needs loss scaling" in err[0], err
