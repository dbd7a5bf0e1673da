"""accumix.jax: the fp16 scaler (the shared golden table), skipped windows, policies, errors."""

from __future__ import annotations

import warnings

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import accumix as ax  # noqa: E402
import accumix.jax as axj  # noqa: E402
from accumix.jax.loss_scale import LossScaleRule  # noqa: E402
from tests import jax_workloads as w  # noqa: E402
from tests.loss_scale_traces import IDS, TRACES  # noqa: E402

K = 2


@pytest.fixture(autouse=True)
def _quiet_emulation_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*emulated.*")
        yield


@pytest.mark.parametrize("trace", TRACES, ids=IDS)
def test_golden_traces_on_the_jitted_scaler(trace) -> None:
    """The same table as the torch scaler's test, through the jnp update inside jit."""
    rule = LossScaleRule(ax.DynamicLossScale(**trace["settings"]))
    state = rule.init()
    update = jax.jit(rule.update)
    for found_inf, expected in zip(trace["overflows"], trace["scales"], strict=True):
        state = update(state, jnp.asarray(found_inf))
        if expected is None:
            with pytest.raises(ax.LossScaleError, match="bf16"):
                rule.check(state)
            return
        rule.check(state)
        assert float(state.scale) == expected


def fp16_accelerator(**scale):
    acc = axj.Accelerator(strategy="fsdp", precision="fp16-mixed", grad_accum_steps=K,
                          loss_scale=ax.DynamicLossScale(**scale))
    return acc, acc.setup(w.init_params(), w.optimizer())


def test_overflow_on_one_device_skips_every_device_and_keeps_the_state_bitwise() -> None:
    acc, state = fp16_accelerator(init_scale=1024.0, growth_interval=100)
    step = acc.train_step(w.item_loss)
    clean = w.micro_batches(K, seed=3)
    bad = w.micro_batches(K, seed=4)
    bad[1]["y"][-1, 0] = np.inf  # the last row: device 1's half only
    scales, skipped, steps = [], [], []
    for window in (clean, bad, bad, clean):
        before = [np.asarray(x) for x in jax.tree.leaves((state.params, state.opt_state))]
        state, m = step(state, window)
        scales.append(float(m["loss_scale"]))
        skipped.append(bool(m["skipped"]))
        steps.append(int(state.step))
        after = [np.asarray(x) for x in jax.tree.leaves((state.params, state.opt_state))]
        same = all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
        assert same == skipped[-1]
    assert skipped == [False, True, True, False]
    assert scales == [1024.0, 1024.0, 512.0, 512.0]  # hysteresis 2: the first is absorbed
    assert steps == [1, 1, 1, 2]
    assert int(state.opt_state[0].count) == 2  # Adam's count: finite windows only


def test_no_host_transfer_inside_the_step() -> None:
    acc, state = fp16_accelerator(init_scale=1024.0)
    step = acc.train_step(w.item_loss, check_every=10**6)
    window = acc.window(w.micro_batches(K))
    state, _ = step(state, window)  # compile outside the guard
    window = acc.window(w.micro_batches(K, seed=5))
    with jax.transfer_guard_device_to_host("disallow"):
        state, metrics = step(state, window)
    assert not bool(metrics["skipped"])


def test_overflow_at_the_floor_raises_loss_scale_error() -> None:
    acc, state = fp16_accelerator(init_scale=2.0, min_scale=1.0, hysteresis=1)
    step = acc.train_step(w.item_loss, check_every=1)
    bad = w.micro_batches(K)
    bad[0]["x"][0, 0, 0] = np.inf
    state, m = step(state, bad)  # 2 -> 1
    assert float(m["loss_scale"]) == 1.0
    with pytest.raises(ax.LossScaleError, match="precision='bf16-mixed'"):
        step(state, bad)


def test_fp16_item_mode_does_not_overflow_on_many_tokens() -> None:
    """A summed loss over many items x 65536 would overflow fp16; the first window steps."""
    acc = axj.Accelerator(strategy="ddp", precision="fp16-mixed", grad_accum_steps=K)
    state = acc.setup(w.init_params(), w.optimizer())
    step = acc.train_step(w.item_loss)
    big = w.micro_batches(K, rows=512, ragged=False)
    state, m = step(state, big)
    assert not bool(m["skipped"]) and float(m["loss_scale"]) == 2.0**16
    ref = w.reference([big], items=True)
    assert w.max_diff(state.params, ref) < 2e-2  # fp16 compute, one Adam step of 1e-2


@pytest.mark.parametrize("precision,param_dtype,close", [
    ("bf16-mixed", jnp.float32, 3e-2), ("bf16-true", jnp.bfloat16, 6e-2)])
def test_bf16_policies(precision, param_dtype, close) -> None:
    acc = axj.Accelerator(strategy="ddp", precision=precision, grad_accum_steps=K)
    state = acc.setup(w.init_params(), w.optimizer())
    assert state.params["hidden"]["w"].dtype == param_dtype
    assert state.opt_state[0].mu["hidden"]["w"].dtype == param_dtype
    step = acc.train_step(w.item_loss)
    windows = [w.micro_batches(K, seed=s) for s in (1, 2)]
    for window in windows:
        state, m = step(state, window)
    assert float(m["loss_scale"]) == 1.0 and not bool(m["skipped"])
    assert 0 < w.max_diff(state.params, w.reference(windows, items=True)) < close


def test_mixed_precision_casts_params_once_per_window_and_leaves_the_batch() -> None:
    """Half params, float32 batch: masks and item counts are not rounded to bf16."""
    acc = axj.Accelerator(strategy="ddp", precision="bf16-mixed", grad_accum_steps=K)
    state = acc.setup(w.init_params(), w.optimizer())
    seen = []

    def loss_fn(params, batch, rng):
        seen.append((params["hidden"]["w"].dtype, batch["x"].dtype, batch["mask"].dtype))
        return w.item_loss(params, batch, rng)

    step = acc.train_step(loss_fn)
    state, _ = step(state, w.micro_batches(K))
    assert {tuple(jnp.dtype(d) for d in s) for s in seen} == {
        (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.float32))}


def test_auto_precision_follows_the_cpu_rule(monkeypatch) -> None:
    from accumix.jax import precision as jp
    from accumix.precision import words

    for native, expected in ((True, "bf16-mixed"), (False, "fp32")):
        monkeypatch.setattr(jp, "cpu_has_native_bf16", lambda n=native: n)
        assert jp.resolve_jax_policy("auto", "cpu").name == expected
    assert jp.resolve_jax_policy("auto", "gpu").name == "bf16-mixed"
    assert words.PRECISION_WORDS == ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true", "auto")


@pytest.mark.parametrize("kwargs,match", [
    (dict(strategy="deepspeed"), "PyTorch engine.*'zero1'.*'fsdp'"),
    (dict(strategy="megatron"), "unknown strategy 'megatron'.*single, ddp, zero1, fsdp"),
    (dict(precision="fp8"), "unknown precision 'fp8'"),
    (dict(global_batch_size=10, micro_batch_size=4), "not a multiple.*micro batch sizes"),
    (dict(grad_accum_steps=0), "grad_accum_steps=0 is invalid"),
    (dict(precision="bf16-mixed", loss_scale=ax.DynamicLossScale()), "only used by"),
])
def test_bad_settings_are_one_line_config_errors(kwargs, match) -> None:
    with pytest.raises(ax.ConfigError, match=match) as info:
        axj.Accelerator(**kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("loss_fn,match", [
    (lambda p, b, r: (1.0, 2.0, 3.0, 4.0), "a 4-tuple"),
    (lambda p, b, r: w.forward(p, b["x"]), "a loss of shape"),
])
def test_a_loss_fn_of_the_wrong_structure_is_a_config_error(loss_fn, match) -> None:
    acc = axj.Accelerator(strategy="ddp", precision="fp32", grad_accum_steps=K)
    state = acc.setup(w.init_params(), w.optimizer())
    step = acc.train_step(loss_fn)
    with pytest.raises(ax.ConfigError, match=match):
        step(state, w.micro_batches(K))


def test_bad_windows_and_optimizers_are_config_errors() -> None:
    acc = axj.Accelerator(strategy="ddp", precision="fp32", grad_accum_steps=K)
    with pytest.raises(ax.ConfigError, match="optax"):
        acc.setup(w.init_params(), object())
    acc.setup(w.init_params(), optax.sgd(0.1))
    with pytest.raises(ax.ConfigError, match="1 to grad_accum_steps=2"):
        acc.window(w.micro_batches(3))
    odd = w.micro_batches(1, rows=3)
    with pytest.raises(ax.ConfigError, match="2 devices"):
        acc.window(odd)
    with pytest.raises(ax.ConfigError, match="same shapes"):
        acc.window(w.micro_batches(1) + w.micro_batches(1, rows=2))


def test_auto_strategy_uses_the_memory_model_and_single_for_one_device(monkeypatch) -> None:
    import optax

    from accumix.jax import memory

    acc = axj.Accelerator(strategy="auto", precision="fp32", grad_accum_steps=K)
    with pytest.raises(ax.ConfigError, match="chosen at acc.setup"):
        _ = acc.num_devices
    acc.setup(w.init_params(), w.optimizer())
    assert acc.strategy.name == "ddp" and acc.num_devices == 2  # a tiny model fits replicated
    # Three leaves of 100 fp32 params, Adam, 2 devices (accumix.jax.memory's table): ddp 6004
    # bytes per device, zero1 4804, fsdp 3804, fsdp sync 3204 (one leaf gathered at a time);
    # the budget is 80% of free.
    params = {k: np.zeros(100, np.float32) for k in "abc"}
    choose = lambda free: repr(memory.choose_auto(  # noqa: E731
        params, optax.adam(1e-3), precision="fp32", free_bytes=free))
    assert choose(7600) == "DDPStrategy()"
    assert choose(6100) == "ZeRO1Strategy()"
    assert choose(5800) == "FSDPStrategy(sync_each_microstep=False)"
    assert choose(4300) == choose(10) == "FSDPStrategy(sync_each_microstep=True)"
    monkeypatch.setattr(memory.jax, "devices", lambda: jax.local_devices()[:1])
    assert choose(10) == "SingleStrategy()"
