"""accumix.jax against plain JAX/optax where a run used to go silently wrong (issue 19).

Zero-item windows, aux read as num_items, complex params, integer and key leaves, ``len`` of the
windows, optimizers that read the loss, nnx key paths, integer item counts past 2**24, and a
``loss_scale`` that ``precision="auto"`` does not use.
"""

from __future__ import annotations

import logging

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import accumix as ax  # noqa: E402
import accumix.jax as axj  # noqa: E402
from tests import jax_workloads as w  # noqa: E402

K = 2


def plain_train(windows, grad_fn, *, params=None, tx=None):
    """One device, one large batch per window, optax as documented (``value=`` included)."""
    p = jax.tree.map(jnp.asarray, params or w.init_params())
    tx = tx or w.optimizer()
    state = tx.init(p)
    for window in windows:
        loss, grads = grad_fn(p, w.concat(window))
        updates, state = tx.update(grads, state, p, value=loss)
        p = optax.apply_updates(p, updates)
    return p


def item_grads(p, big):
    """The item mean's gradient, zero for a window without items (the torch side's rule)."""
    def mean(q):
        loss_sum, count = w.item_loss(q, big, None)
        return loss_sum / jnp.maximum(count, 1)
    return jax.value_and_grad(mean)(p)


def mean_grads(p, big):
    return jax.value_and_grad(lambda q: w.mean_loss(q, big, None))(p)


def run(strategy, windows, loss_fn, *, params=None, tx=None, precision="fp32"):
    acc = axj.Accelerator(strategy=strategy, precision=precision, grad_accum_steps=K)
    state = acc.setup(params or w.init_params(), tx or w.optimizer())
    step = acc.train_step(loss_fn)
    metrics = []
    for window in windows:
        state, m = step(state, window)
        metrics.append(jax.device_get(m))
    return acc, state, metrics


@pytest.mark.parametrize("strategy", ["single", "ddp", "zero1", "fsdp"])
def test_a_window_without_items_takes_zero_gradients_and_says_so(strategy) -> None:
    batches = w.micro_batches(3 * K, seed=3)
    for micro in batches[K:2 * K]:
        micro["mask"][:] = 0  # the second window is all padding
    windows = [batches[i:i + K] for i in range(0, 3 * K, K)]
    _, state, metrics = run(strategy, windows, w.item_loss)
    ref = plain_train(windows, item_grads)
    assert w.max_diff(state.params, ref) < 1e-6  # before: every param NaN
    assert (float(metrics[1]["num_items"]), float(metrics[1]["loss"]),
            float(metrics[1]["grad_norm"])) == (0.0, 0.0, 0.0)
    assert int(state.step) == 3


def test_fp16_window_without_items_is_a_clean_zero_step() -> None:
    batches = w.micro_batches(K, seed=3)
    for micro in batches:
        micro["mask"][:] = 0
    _, state, metrics = run("ddp", [batches], w.item_loss, precision="fp16-mixed")
    assert not bool(metrics[0]["skipped"]) and int(state.step) == 1
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))


def accuracy_loss(params, batch, rng):
    """A mean loss with a scalar metric: the 2-tuple that used to train as (sum, count)."""
    err = (w.forward(params, batch["x"]) - batch["y"]) ** 2
    return jnp.mean(err), jnp.mean((err < 0.5).astype(jnp.float32))


def test_a_scalar_metric_computed_from_the_params_is_aux_not_num_items() -> None:
    windows = [w.micro_batches(K, seed=i) for i in range(3)]
    _, state, metrics = run("ddp", windows, accuracy_loss)
    assert w.max_diff(state.params, plain_train(windows, mean_grads)) < 1e-6  # before: 0.24
    params = jax.tree.map(jnp.asarray, w.init_params())
    first = [accuracy_loss(params, m, None) for m in windows[0]]
    assert float(metrics[0]["loss"]) == pytest.approx(np.mean([f[0] for f in first]), rel=1e-6)
    assert "aux" in metrics[0]


def test_loss_result_type_and_the_refused_ambiguous_tuple() -> None:
    windows = [w.micro_batches(K, seed=i) for i in range(2)]
    explicit = lambda p, b, r: axj.Loss(*w.item_loss(p, b, r), aux={"n": b["mask"].sum()})  # noqa: E731
    _, state, metrics = run("fsdp", windows, explicit)
    assert w.max_diff(state.params, plain_train(windows, item_grads)) < 1e-6
    assert float(metrics[0]["aux"]["n"]) == pytest.approx(
        float(w.concat(windows[0])["mask"].sum()) / (K * 2))
    # A jitted or rematerialised loss_fn is read through: its count is still a count.
    for wrapped in (jax.jit(w.item_loss), jax.checkpoint(w.item_loss)):
        _, state, _ = run("ddp", windows, wrapped)
        assert w.max_diff(state.params, plain_train(windows, item_grads)) < 1e-6
    # (loss_sum, count of shape (1,)): was read as (mean, aux) and trained on the sum.
    shaped = lambda p, b, r: (w.item_loss(p, b, r)[0], b["mask"].sum()[None])  # noqa: E731
    with pytest.raises(ax.ConfigError, match=r"shape \(1,\).*axj.Loss") as info:
        run("ddp", windows, shaped)
    assert "\n" not in str(info.value).split("\n---")[0]


def test_eval_step_reads_the_loss_alike() -> None:
    acc = axj.Accelerator(strategy="ddp", precision="fp32", grad_accum_steps=1)
    state = acc.setup(w.init_params(), w.optimizer())
    (batch,) = w.micro_batches(1, rows=4, seed=2)
    params = jax.tree.map(jnp.asarray, w.init_params())
    loss_sum, items = acc.eval_step(accuracy_loss)(state, batch)
    halves = [jax.tree.map(lambda x, i=i: x[i * 2:(i + 1) * 2], batch) for i in (0, 1)]
    expected = sum(float(accuracy_loss(params, h, None)[0]) * 2 for h in halves)
    assert (float(loss_sum), float(items)) == (pytest.approx(expected, rel=1e-6), 4.0)
    loss_sum, items = acc.eval_step(lambda p, b, r: axj.Loss(*w.item_loss(p, b, r)))(state, batch)
    ref_sum, ref_items = w.item_loss(params, batch, None)
    assert float(items) == float(ref_items)
    assert float(loss_sum) == pytest.approx(float(ref_sum), rel=1e-6)


def test_eval_step_takes_a_last_batch_its_devices_do_not_divide() -> None:
    """A validation set's last batch (3 rows, 1 row on 2 devices) is evaluated, each row once;
    before: a ConfigError (on 4 or 8 devices most validation sets end so)."""
    acc = axj.Accelerator(strategy="ddp", precision="fp32", grad_accum_steps=1)
    state = acc.setup(w.init_params(), w.optimizer())
    params = jax.tree.map(jnp.asarray, w.init_params())
    mean_eval = acc.eval_step(w.mean_loss)
    item_eval = acc.eval_step(w.item_loss)
    for rows in (3, 1):
        (batch,) = w.micro_batches(1, rows=rows, seed=rows)
        each = [jax.tree.map(lambda x, i=i: x[i:i + 1], batch) for i in range(rows)]
        loss_sum, items = mean_eval(state, batch)
        expected = sum(float(w.mean_loss(params, row, None)) for row in each)
        assert (float(loss_sum), float(items)) == (pytest.approx(expected, rel=1e-6), rows)
        loss_sum, items = item_eval(state, batch)
        ref_sum, ref_items = w.item_loss(params, batch, None)
        assert float(items) == float(ref_items)
        assert float(loss_sum) == pytest.approx(float(ref_sum), rel=1e-6)
        assert [float(x) for x in item_eval(state, batch, weight=0.0)] == [0.0, 0.0]


def test_loss_fn_is_traced_on_one_devices_rows_only() -> None:
    """``loss_fn`` sees one device's rows of a micro-batch (README): a loss that reshapes to that
    batch trains. Before, the step read the loss's form by tracing it on the whole window's rows
    (4 here, 2 per device): the reshape raised a TypeError."""
    seen = set()

    def per_device(params, batch, rng):
        seen.add(batch["x"].shape[0])
        x = batch["x"].reshape(w.ROWS // 2, 3, 4)  # this device's rows, written out
        return jnp.mean((w.forward(params, x) - batch["y"]) ** 2)

    windows = [w.micro_batches(K, seed=i, ragged=False) for i in range(2)]
    _, state, _ = run("ddp", windows, per_device)
    assert seen == {w.ROWS // 2}
    assert w.max_diff(state.params, plain_train(windows, mean_grads)) < 1e-6


def complex_loss(params, batch, rng):
    """A real loss of complex params whose imaginary parts matter (a complex target)."""
    err = batch["x"].astype(jnp.complex64) @ params["z"] - (batch["y"] + 1j * batch["y"][:, ::-1])
    return jnp.mean(jnp.abs(err) ** 2)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_complex_params_keep_their_imaginary_gradient(strategy) -> None:
    rng = np.random.default_rng(0)
    params = {"z": (rng.normal(size=(4, 2)) + 1j * rng.normal(size=(4, 2))).astype(np.complex64)}
    windows = [[{"x": rng.normal(size=(4, 4)).astype(np.float32),
                 "y": rng.normal(size=(4, 2)).astype(np.float32)} for _ in range(K)]
               for _ in range(3)]
    tx = optax.adam(1e-2)
    _, state, _ = run(strategy, windows, complex_loss, params=params, tx=tx)
    ref = plain_train(windows, lambda p, b: jax.value_and_grad(complex_loss)(p, b, None),
                      params=params, tx=tx)
    assert state.params["z"].dtype == jnp.complex64
    diff = float(jnp.max(jnp.abs(state.params["z"] - ref["z"])))
    assert diff < 1e-6, diff  # before: 2.9e-2 (the imaginary part never moved)


def test_integer_and_key_leaves_are_carried_saved_and_restored(tmp_path) -> None:
    params = {**w.init_params(), "count": np.int32(7),
              "rngs": {"key": jax.random.key(3), "n": np.arange(4, dtype=np.uint32)}}
    windows = [w.micro_batches(K, seed=i) for i in range(3)]
    acc, state, _ = run("fsdp", windows[:2], w.item_loss, params=params)
    assert int(state.params["count"]) == 7
    assert np.array_equal(jax.random.key_data(state.params["rngs"]["key"]),
                          jax.random.key_data(jax.random.key(3)))
    floats = {k: v for k, v in params.items() if k in ("hidden", "out")}
    ref = plain_train(windows[:2], item_grads, params=floats)
    assert w.max_diff({k: state.params[k] for k in floats}, ref) < 1e-6
    acc.save_state(tmp_path / "run", state)
    fresh = acc.setup(params, w.optimizer())
    restored = acc.load_state(tmp_path / "run", fresh)
    assert int(restored.step) == 2 and int(restored.params["count"]) == 7
    saved = jax.tree.leaves(jax.tree.map(_bits, state.params))
    assert all(np.array_equal(a, b) for a, b in zip(
        saved, jax.tree.leaves(jax.tree.map(_bits, restored.params)), strict=True))
    step = acc.train_step(w.item_loss)
    restored, _ = step(restored, windows[2])
    ref = plain_train(windows, item_grads, params=floats)
    assert w.max_diff({k: restored.params[k] for k in floats}, ref) < 1e-6


def _bits(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)


def test_len_of_the_windows_is_what_iteration_yields() -> None:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.arange(22 * 4, dtype=torch.float32).reshape(22, 4))
    acc = axj.Accelerator(strategy="ddp", precision="fp32", grad_accum_steps=5)
    _, windows = acc.setup(w.init_params(), w.optimizer(), DataLoader(data, batch_size=4))
    assert (len(windows), len(list(windows))) == (1, 1)  # before: len 2
    assert windows.batches_per_epoch == 5
    acc = axj.Accelerator(strategy="ddp", precision="fp32", grad_accum_steps=2)
    _, windows = acc.setup(w.init_params(), w.optimizer(),
                           DataLoader(data, batch_size=4, drop_last=True))
    assert (len(windows), len(list(windows))) == (3, 3)


def test_optimizers_that_read_the_loss_get_value() -> None:
    tx = optax.chain(optax.adam(1e-2),
                     optax.contrib.reduce_on_plateau(patience=1, factor=0.5, cooldown=0))
    windows = [w.micro_batches(K, seed=0)] * 3
    _, state, metrics = run("ddp", windows, w.item_loss, tx=tx)  # before: TypeError 'value'
    ref = plain_train(windows, item_grads, tx=tx)
    assert w.max_diff(state.params, ref) < 1e-6
    # The plateau transform saw the window losses: its best is the lowest one.
    best = min(float(m["loss"]) for m in metrics)
    assert float(state.opt_state[1].best_value) == pytest.approx(best, rel=1e-6)


def test_integer_item_counts_are_exact_past_2_to_the_24() -> None:
    def loss_fn(params, batch, rng):
        loss_sum, _ = w.item_loss(params, batch, rng)
        return loss_sum, jnp.sum(batch["n"])

    # Per micro-batch 2**24 + 1 items: device sums 2**23 and 2**23 + 1 are exact in float32,
    # the window's 2**25 + 2 is not.
    counts = np.array([2**22, 2**22, 2**22, 2**22 + 1], np.int32)
    windows = [[{**m, "n": counts} for m in w.micro_batches(K, seed=1)]]
    _, _, metrics = run("ddp", windows, loss_fn)
    assert int(metrics[0]["num_items"]) == K * (2**24 + 1)  # before: 33554432 (rounded)


def test_save_model_names_nnx_params_as_flax_does(tmp_path) -> None:
    from flax import nnx
    from safetensors.numpy import load_file

    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.l1 = nnx.Linear(4, 2, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

    _, params, _ = nnx.split(Model(nnx.Rngs(0)), nnx.Param, ...)
    acc = axj.Accelerator(strategy="ddp", precision="fp32", grad_accum_steps=1)
    state = acc.setup(params, w.optimizer())
    tensors = load_file(str(acc.save_model(tmp_path, state)))
    flat = {".".join(map(str, k)) for k, _ in nnx.to_flat_state(params)}
    assert sorted(tensors) == sorted(flat) == ["l1.bias", "l1.kernel"]  # before: l1.bias.value
    assert tensors["l1.kernel"].dtype == np.float32


def test_an_nnx_dropout_held_in_the_params_draws_anew_each_micro_step() -> None:
    """A flax nnx model split whole (its ``Rngs`` key and count carried in the params): its
    Dropout draws another mask on each micro-step, device and window, as ``rng`` does. Before,
    loss_fn could not hand back the advanced count: every micro-step, device and window used
    one mask (the window mean of a row's mask stayed 0 or 1, the same each window)."""
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.drop = nnx.Dropout(0.5, rngs=rngs)
            # A key that is no stream (no count beside it): a fixed random projection's seed.
            self.seed = nnx.Variable(jax.random.key(3))

    graphdef, params = nnx.split(Model(nnx.Rngs(dropout=1)))
    stored = jax.random.key_data(params["drop"]["rngs"]["key"].get_value())

    def loss_fn(p, batch, rng):
        model = nnx.merge(graphdef, p)
        kept = (model.drop(jnp.ones((16,))) != 0).astype(jnp.float32)
        projection = jax.random.normal(model.seed.get_value(), (16,))
        return jnp.mean(batch["x"]) * 0.0, {"kept": kept, "projection": projection}

    windows = [w.micro_batches(K, seed=i) for i in range(2)]
    _, state, metrics = run("ddp", windows, loss_fn, params=params, tx=optax.sgd(0.1))
    kept = [np.asarray(m["aux"]["kept"]) for m in metrics]  # means over 2 micro-steps x 2 devices
    assert not np.isin(kept[0], [0.0, 1.0]).all() and not np.array_equal(kept[0], kept[1])
    fixed = np.asarray(jax.random.normal(jax.random.key(3), (16,)))
    for m in metrics:  # the same draw on every micro-step and device: the key reached it as is
        np.testing.assert_allclose(np.asarray(m["aux"]["projection"]), fixed, rtol=0, atol=1e-6)
    # The stored stream is carried unchanged, so a resumed run draws alike.
    after = state.params["drop"]["rngs"]["key"].get_value()
    assert np.array_equal(jax.random.key_data(after), stored)


@pytest.mark.parametrize("strategy", ["single", "ddp-one-device"])
def test_an_nnx_dropout_in_the_params_trains_and_resumes_on_one_device(strategy,
                                                                       tmp_path) -> None:
    """Issue 38 case 7: on a one-device mesh the ``Rngs`` key leaf was placed with its bits'
    spec (``P(None,)`` for a scalar key) and the step's shard_map refused it ("in_specs entry
    which is too long"), in ``train_step`` and after ``load_state``. Now it trains with the
    dropout on, and a resumed window is bitwise the uninterrupted one."""
    from flax import nnx

    from accumix.jax import trainable

    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.l1 = nnx.Linear(4, 1, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

    graphdef, params = nnx.split(Model(nnx.Rngs(0, dropout=1)))

    def loss_fn(p, batch, rng):
        model = nnx.merge(graphdef, p)
        dropped = model.drop(batch["x"][:, 0])
        err = (model.l1(dropped)[..., 0] - batch["y"][:, 0]) ** 2 * batch["mask"][:, 0]
        return err.sum(), batch["mask"][:, 0].sum(), {"kept": (dropped != 0).mean()}

    def accelerator():
        word = axj.DDPStrategy(devices=jax.devices()[:1]) if strategy != "single" else strategy
        return axj.Accelerator(strategy=word, precision="fp32", grad_accum_steps=K)

    windows = [w.micro_batches(K, seed=i) for i in range(2)]
    acc = accelerator()
    state = acc.setup(params, optax.sgd(0.1))
    assert acc.num_devices == 1
    step = acc.train_step(loss_fn)
    state, first = step(state, acc.window(windows[0]))
    acc.save_state(tmp_path, state)
    state, _ = step(state, acc.window(windows[1]))
    again = accelerator()
    loaded = again.load_state(tmp_path, again.setup(params, optax.sgd(0.1)))
    loaded, _ = again.train_step(loss_fn)(loaded, again.window(windows[1]))
    assert int(state.step) == int(loaded.step) == 2
    weights = [[np.asarray(x) for x in jax.tree.leaves(s.params) if trainable.is_trainable(x)]
               for s in (state, loaded)]
    assert len(weights[0]) == 2 and all(
        np.array_equal(a, b) for a, b in zip(*weights, strict=True))
    kept = float(first["aux"]["kept"])  # dropout ran: the mean over K micro-steps of 4 x 4
    assert 0.2 < kept < 0.8 and np.isfinite(float(first["loss"]))


def test_unused_loss_scale_under_auto_is_said_once_on_both_backends(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="accumix"):
        axj.Accelerator(precision="auto", loss_scale=ax.DynamicLossScale(init_scale=8.0))
        ax.Accelerator(precision="auto", loss_scale=ax.DynamicLossScale(init_scale=8.0))
    said = [r.getMessage() for r in caplog.records if "loss_scale" in r.getMessage()]
    assert len(said) == 2 and all("precision='auto' chose" in s for s in said), said


def cond_item_loss(params, batch, rng):
    """``(loss_sum, num_items)`` returned from inside a ``lax.cond``: a count all the same."""
    return jax.lax.cond(jnp.sum(batch["mask"]) > 0, lambda q: w.item_loss(q, batch, None),
                        lambda q: w.item_loss(q, batch, None), params)


def test_a_count_returned_through_cond_scan_or_while_is_read_by_its_data_flow() -> None:
    batches = w.micro_batches(2 * K, seed=5)
    windows = [batches[i:i + K] for i in range(0, 2 * K, K)]
    _, state, metrics = run("ddp", windows, cond_item_loss)
    ref = plain_train(windows, item_grads)
    # before: the cond's count was read as aux and the summed loss as a mean (diff 2.3e-3)
    assert w.max_diff(state.params, ref) < 1e-6
    assert float(metrics[0]["num_items"]) == float(sum(b["mask"].sum() for b in windows[0]))

    from accumix.jax.loss_output import read_form
    p = jax.tree.map(jnp.asarray, w.init_params())
    micro = batches[0]

    def scan_carry(params, batch, rng):  # the second carry picks up the loss one step late
        def body(c, _):
            return (w.item_loss(params, batch, None)[0], c[1] + c[0]), None
        (s, x), _ = jax.lax.scan(body, (0.0, 0.0), None, length=3)
        return s, x

    def while_trips(params, batch, rng):  # how often the loop runs depends on the params
        s, n = w.item_loss(params, batch, None)
        _, x = jax.lax.while_loop(lambda c: c[0] < s, lambda c: (c[0] + 1.0, c[1] + 1.0),
                                  (0.0, 0.0))
        return s, x

    key = jax.random.key(0)
    assert read_form(scan_carry, p, micro, key).aux_at == 1  # before: items_at=1
    assert read_form(while_trips, p, micro, key).aux_at == 1  # kept (the loop is followed)
