"""accumix.jax: accumulation equals the large batch, for every strategy, on 2 CPU devices."""

from __future__ import annotations

from contextlib import nullcontext

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import accumix.jax as axj  # noqa: E402
from accumix.jax.hlo import collective_counts  # noqa: E402
from tests import jax_workloads as w  # noqa: E402

K = 4
STRATEGIES = ["single", "ddp", "zero1", "fsdp"]


def train(strategy, windows, *, items=True, precision="fp32", clip_norm=None, k=K):
    acc = axj.Accelerator(strategy=strategy, precision=precision, grad_accum_steps=k)
    state = acc.setup(w.init_params(), w.optimizer())
    step = acc.train_step(w.item_loss if items else w.mean_loss, clip_norm=clip_norm)
    metrics = []
    for window in windows:
        state, m = step(state, window)
        metrics.append({k: float(v) for k, v in m.items()})
    return acc, state, step, metrics


def windows_of(batches, k=K):
    return [batches[i:i + k] for i in range(0, len(batches), k)]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_equals_the_large_batch_in_both_modes(strategy) -> None:
    assert len(jax.devices()) == 2, "tests/conftest.py sets two host devices"
    windows = windows_of(w.micro_batches(3 * K))
    for items in (True, False):
        acc, state, _, metrics = train(strategy, windows, items=items, clip_norm=0.5)
        ref = w.reference(windows, items=items, clip_norm=0.5)
        assert w.max_diff(state.params, ref) < 1e-6, (strategy, items)
        assert int(state.step) == 3
        assert acc.num_devices == (1 if strategy == "single" else 2)
        # The logged loss is the window's true mean (item-weighted in item mode).
        big = w.concat(windows[-1])
        assert metrics[-1]["num_items"] == (big["mask"].sum() if items else K * w.ROWS)
    if strategy == "fsdp":  # params really sharded: the largest dimension that 2 divides
        assert state.params["hidden"]["w"].sharding.spec == jax.sharding.PartitionSpec(
            None, "data")
    if strategy == "zero1":
        mu = state.opt_state[0].mu["hidden"]["w"]
        assert mu.sharding.spec == jax.sharding.PartitionSpec(None, "data")
        assert state.params["hidden"]["w"].sharding.spec == jax.sharding.PartitionSpec()


def test_mean_of_means_is_far_off_so_the_check_has_power() -> None:
    windows = windows_of(w.micro_batches(3 * K))
    exact = w.reference(windows, items=True)
    assert w.max_diff(w.mean_of_means(windows), exact) > 1e-3
    _, state, _, _ = train("ddp", windows)
    assert w.max_diff(state.params, exact) < 1e-6


def test_short_last_window_is_masked_and_divided_by_its_true_count() -> None:
    batches = w.micro_batches(K + 2)  # a full window, then 2 of 4 micro-batches
    windows = [batches[:K], batches[K:]]
    for items in (True, False):
        _, state, step, metrics = train("fsdp", windows, items=items)
        assert w.max_diff(state.params, w.reference(windows, items=items)) < 1e-6
        assert step.jitted._cache_size() == 1  # the short window did not recompile
    assert metrics[-1]["num_items"] == 2 * w.ROWS  # mean mode: the rows really used


def test_loss_metric_is_the_item_weighted_mean() -> None:
    windows = windows_of(w.micro_batches(K))
    _, _, _, metrics = train("ddp", windows)
    big = w.concat(windows[0])
    loss_sum, items = w.item_loss(jax.tree.map(jnp.asarray, w.init_params()), big, None)
    assert metrics[0]["loss"] == pytest.approx(float(loss_sum / items), rel=1e-6)
    grads = jax.grad(lambda p: (lambda s, n: s / n)(*w.item_loss(p, big, None)))(
        jax.tree.map(jnp.asarray, w.init_params()))
    norm = float(jnp.sqrt(sum(jnp.sum(g ** 2) for g in jax.tree.leaves(grads))))
    assert metrics[0]["grad_norm"] == pytest.approx(norm, rel=1e-5)


@pytest.mark.parametrize("strategy,kind", [("ddp", "all-reduce"), ("zero1", "all-reduce"),
                                           ("fsdp", "reduce-scatter")])
def test_one_gradient_reduction_per_window_outside_the_scan(strategy, kind) -> None:
    acc, state, step, _ = train(strategy, [])
    window = acc.window(w.micro_batches(K))
    counts = collective_counts(step.lower(state, window).compile().as_text())
    # fsdp gathers each param at its use, inside the body (tests/unit/test_jax_fsdp.py).
    assert sum(n for k, n in counts["in_loop"].items() if k != "all-gather") == 0, counts
    assert strategy == "fsdp" or counts["in_loop"]["all-gather"] == 0, counts
    assert counts["outside"][kind] >= 1, counts


def test_hlo_reader_sees_a_reduction_inside_a_plain_jit_scan() -> None:
    """The peer pattern (plain jit + NamedSharding + scan) reduces every micro-step: the reader
    must see it, or the test above could not fail."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = axj.DDPStrategy().mesh
    params = jax.device_put(jax.tree.map(jnp.asarray, w.init_params()),
                            NamedSharding(mesh, P()))
    batch = jax.device_put(w.concat([w.concat([b]) for b in w.micro_batches(1)]),
                           NamedSharding(mesh, P("data")))
    stacked = jax.tree.map(lambda x: jnp.stack([x] * K), batch)

    def naive(p, xs):
        def body(acc, micro):
            g = jax.grad(lambda q: w.item_loss(q, micro, None)[0])(p)
            return jax.tree.map(jnp.add, acc, g), None
        return jax.lax.scan(body, jax.tree.map(jnp.zeros_like, p), xs)[0]

    stacked = jax.device_put(stacked, NamedSharding(mesh, P(None, "data")))
    text = jax.jit(naive, out_shardings=NamedSharding(mesh, P())).lower(
        params, stacked).compile().as_text()
    assert collective_counts(text)["in_loop"]["all-reduce"] >= 1


def test_torch_and_jax_backends_agree() -> None:
    """The same MLP and data through accumix (torch) and accumix.jax: within 1e-5."""
    import torch

    import accumix as ax

    params = w.init_params()
    windows = windows_of(w.micro_batches(2 * K))
    _, state, _, _ = train("ddp", windows, clip_norm=0.5)

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    with torch.no_grad():
        model[0].weight.copy_(torch.from_numpy(params["hidden"]["w"].T.copy()))
        model[0].bias.copy_(torch.from_numpy(params["hidden"]["b"]))
        model[2].weight.copy_(torch.from_numpy(params["out"]["w"].T.copy()))
        model[2].bias.copy_(torch.from_numpy(params["out"]["b"]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.01)
    acc = ax.Accelerator(strategy="single", precision="fp32", grad_accum_steps=K)
    model, opt = acc.setup(model, opt)
    for window in windows:
        for micro in window:
            with acc.accumulate():
                b = {k: torch.from_numpy(v) for k, v in micro.items()}
                err = (model(b["x"])[..., 0] - b["y"]) ** 2 * b["mask"]
                acc.backward(err.sum(), num_items=b["mask"].sum())
                acc.clip_grad_norm_(0.5)
                opt.step()
                opt.zero_grad()
    acc.end()
    torch_params = {"hidden": {"w": model[0].weight.detach().numpy().T,
                               "b": model[0].bias.detach().numpy()},
                    "out": {"w": model[2].weight.detach().numpy().T,
                            "b": model[2].bias.detach().numpy()}}
    assert w.max_diff(state.params, torch_params) < 1e-5


def test_window_from_the_loop_matches_a_list() -> None:
    acc = axj.Accelerator(strategy="ddp", precision="fp32", grad_accum_steps=K)
    acc.setup(w.init_params(), w.optimizer())
    window = acc.window(w.micro_batches(3))
    assert window.batch["x"].shape == (K, w.ROWS, 3, 4)  # one process: its rows are global
    assert np.asarray(window.mask).tolist() == [True, True, True, False]
    assert window.batch["x"].sharding.spec == jax.sharding.PartitionSpec(None, "data")


def _uneven(acc, micro, counts):
    """``micro`` (this process's K micro-batches) with device d's real micro-steps
    ``counts[d]``: what processes passing windows of different lengths give the step (one
    process here: the device mask written by hand)."""
    from accumix.jax.data import Window

    window = acc.window(micro)
    mask = np.stack([np.arange(K) < c for c in counts], axis=1)
    sharding = acc.strategy.sharding(acc.strategy.rows_spec(1))
    return Window(batch=window.batch, mask=window.mask,
                  device_mask=jax.make_array_from_process_local_data(sharding, mask))


def test_devices_with_windows_of_different_lengths_equal_the_large_batch() -> None:
    """Issue 30: a device whose micro-step is padding while another's is real runs it too
    (fsdp's gathers and reduce-scatters must be issued by every device: across processes the
    old per-device skip hung) and adds exactly nothing. Devices with 4 and 3 micro-steps, SGD,
    against the large batch of the 7 real ones: item mode for every strategy; a token mean
    that is 0/0 on an all-padding micro-batch (the padded device recomputes its real
    micro-batch 0 with a zero seed, so no NaN reaches a sum); fp16 equal to ddp."""
    import optax

    micro = w.micro_batches(K, rows=4, seed=5, ragged=False)
    rows = [jax.tree.map(lambda x, d=d: x[2 * d:2 * d + 2], micro[k])
            for k in range(K) for d, count in enumerate((4, 3)) if k < count]

    def token_mean(params, batch, rng):
        err = (w.forward(params, batch["x"]) - batch["y"]) ** 2 * batch["mask"]
        return err.sum() / batch["mask"].sum()

    def sgd(loss):
        grads = jax.grad(loss)(w.init_params())
        return jax.tree.map(lambda p, g: p - 0.5 * g, w.init_params(), grads)

    cases = [(s, "fp32", w.item_loss, sgd(lambda p: w.large_batch_loss(p, w.concat(rows), True)))
             for s in ("ddp", "zero1", "fsdp", axj.FSDPStrategy(sync_each_microstep=True))]
    mean_ref = sgd(lambda p: sum(token_mean(p, r, None) for r in rows) / len(rows))
    cases += [(axj.FSDPStrategy(sync_each_microstep=True), "fp32", token_mean, mean_ref)]
    ends = {}
    for strategy, precision, loss, ref in cases + [
            (s, "fp16-mixed", w.item_loss, None)
            for s in ("ddp", axj.FSDPStrategy(sync_each_microstep=True))]:
        emulated = precision != "fp32"
        with pytest.warns(UserWarning, match="emulated") if emulated else nullcontext():
            acc = axj.Accelerator(strategy=strategy, precision=precision, grad_accum_steps=K)
        state = acc.setup(w.init_params(), optax.sgd(0.5))
        state, metrics = acc.train_step(loss)(state, _uneven(acc, micro, (4, 3)))
        assert np.isfinite(float(metrics["loss"])), (strategy, precision)
        if ref is not None:
            assert w.max_diff(state.params, ref) < 1e-6, (strategy, loss.__name__)
        else:
            ends[repr(strategy)] = state.params
    assert w.max_diff(*ends.values()) < 1e-6  # fp16: the synced fsdp equals ddp
