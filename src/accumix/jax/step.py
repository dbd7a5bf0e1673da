"""The window step: K micro-steps, one gradient reduction, one optimizer update, one jit.

    params_c = cast(params)                      # once per window, outside the scan
    shard_map over the "data" axis (each device its rows):
        full = gather(params_c)                  # fsdp only
        scan over the K micro-batches:           # masked ones (a short window) cost a cond
            g_i = grad(scale * loss_i)           # item mode in fp16: scale * loss_sum_i / n_i
            acc += float32(g_i)                  #   (then x n_i: fp16 range, exact sum)
        grads = psum | psum_scatter(acc)         # ONE reduction per window, after the scan
    grads /= scale * (N items | k micro-steps x D devices)   # one division, at the end
    found_inf = not all(isfinite(grads))         # global: every device decides alike
    norm = global_norm(grads); clip               # torch's clip_grad_norm_ coefficient
    params, opt_state = found_inf ? kept : optax update    # bit-identical when skipped
    loss_scale = update(loss_scale, found_inf); step += not found_inf

Plain jit with NamedSharding puts the gradient all-reduce inside the scan body (once per
micro-step); shard_map with one collective after the scan puts it outside (JAX.md groundwork).
``check_vma=False`` because the grads of replicated params are per-device partial sums that we
reduce ourselves; with ``check_vma=True`` JAX would psum them already and ours would double-count.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from accumix.errors import ConfigError
from accumix.jax.loss_scale import LossScaleRule
from accumix.jax.precision import JaxPolicy
from accumix.jax.state import TrainState
from accumix.jax.strategies import AXIS, JaxStrategy

LossFn = Callable[[Any, Any, jax.Array], Any]


def split_loss_output(out: Any) -> tuple[Any, Any, Any]:
    """``loss_fn``'s result as (loss, num_items or None, aux or None).

    ``mean_loss`` | ``(loss_sum, num_items)`` | ``(mean_loss, aux)`` | ``(loss_sum, num_items,
    aux)``: a 2-tuple is item mode when its second entry is a scalar, else (loss, aux).

    Raises:
        ConfigError: any other structure, or a loss that is not a scalar.
    """
    aux = items = None
    if isinstance(out, (tuple, list)):
        if len(out) == 3:
            loss, items, aux = out
        elif len(out) == 2 and _is_scalar(out[1]):
            loss, items = out
        elif len(out) == 2:
            loss, aux = out
        else:
            raise ConfigError(_BAD_OUTPUT.format(f"a {len(out)}-tuple"))
    else:
        loss = out
    if not _is_scalar(loss):
        shape = getattr(loss, "shape", type(loss).__name__)
        raise ConfigError(_BAD_OUTPUT.format(f"a loss of shape {shape}"))
    return loss, items, aux


_BAD_OUTPUT = ("loss_fn(params, batch, rng) returned {}; return a scalar mean loss, "
               "(loss_sum, num_items), or either with aux as a last element")


def _is_scalar(x: Any) -> bool:
    return isinstance(x, (int, float)) or (hasattr(x, "shape") and tuple(x.shape) == ())


def is_item_mode(loss_fn: LossFn, params: Any, window: Any) -> bool:
    """Whether ``loss_fn`` returns ``(loss_sum, num_items)`` (traced once, abstractly)."""
    micro = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), window.batch)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    out = jax.eval_shape(loss_fn, shapes, micro, jax.random.key(0))
    return split_loss_output(out)[1] is not None


def build_step(
    loss_fn: LossFn,
    *,
    optimizer: optax.GradientTransformation,
    strategy: JaxStrategy,
    policy: JaxPolicy,
    scaler: LossScaleRule,
    grad_accum_steps: int,
    clip_norm: float | None,
    state_shardings: TrainState,
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]:
    """The jitted ``(state, window) -> (state, metrics)``; ``state`` is donated."""
    param_specs = jax.tree.map(lambda s: s.spec, state_shardings.params)
    scaled = scaler.enabled
    num_devices = strategy.num_devices

    def local_window(params_c: Any, batch: Any, mask: jax.Array, key: jax.Array,
                     scale: jax.Array, *, item_mode: bool) -> tuple[Any, ...]:
        """One device's K micro-steps; returns the reduced sums."""
        device = jax.lax.axis_index(AXIS)
        first = jax.tree.map(lambda x: x[0], batch)
        target = strategy.grad_target(params_c, param_specs)  # what each micro-step differentiates
        one = jnp.float32(1)
        shapes = jax.eval_shape(lambda p, t: strategy.params_at_use(p, t, param_specs, one),
                                params_c, target)
        aux0 = split_loss_output(jax.eval_shape(loss_fn, shapes, first, key))[2]
        # fp16 item mode divides each device's gradient by its own item count (below); a
        # strategy that sums devices inside the backward must multiply it back there first.
        weigh_in_backward = scaled and item_mode and strategy.reduces_each_microstep

        def objective(p: Any, micro: Any, k: jax.Array) -> tuple[jax.Array, tuple[Any, ...]]:
            loss, items, aux = split_loss_output(loss_fn(p, micro, k))
            loss = loss.astype(jnp.float32)
            items = jnp.asarray(items if item_mode else 1, jnp.float32)
            # fp16 item mode: a summed loss x 65536 overflows; scale the sum by 1/n here and by
            # n in float32 below (the torch side divides by an items hint for the same reason).
            per = jnp.maximum(items, 1.0) if (scaled and item_mode) else 1.0
            return loss * (scale / per), (loss, items, aux, per)

        zero_grads = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), target)
        zero_aux = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), aux0)

        def micro_step(carry: tuple[Any, ...], xs: tuple[Any, ...]) -> tuple[Any, None]:
            index, micro, valid = xs

            def compute(_: None) -> tuple[Any, ...]:
                k = jax.random.fold_in(jax.random.fold_in(key, index), device)
                weight = one
                if weigh_in_backward:  # the count alone: XLA drops the rest of this forward
                    p = strategy.params_at_use(params_c, target, param_specs, one)
                    weight = jnp.maximum(jnp.asarray(split_loss_output(
                        loss_fn(p, micro, k))[1], jnp.float32), 1.0)

                def at_use(t: Any, shards: Any) -> tuple[jax.Array, tuple[Any, ...]]:
                    p = strategy.params_at_use(shards, t, param_specs, weight)
                    return objective(p, micro, k)

                # The shards are an argument, not a closure, so remat's optimization barrier
                # covers them (where the backend keeps barriers; see accumix.jax.gather).
                grad, (loss, items, aux, per) = jax.grad(strategy.remat(at_use),
                                                         has_aux=True)(target, params_c)
                per = one if weigh_in_backward else per
                grad = jax.tree.map(lambda g: g.astype(jnp.float32) * per, grad)
                aux = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), aux)
                return grad, loss, items, aux

            def skip(_: None) -> tuple[Any, ...]:
                return zero_grads, jnp.float32(0), jnp.float32(0), zero_aux

            grad, loss, items, aux = jax.lax.cond(valid, compute, skip, None)
            g_acc, l_acc, n_acc, a_acc = carry
            return (jax.tree.map(jnp.add, g_acc, grad), l_acc + loss, n_acc + items,
                    jax.tree.map(jnp.add, a_acc, aux)), None

        carry0 = (zero_grads, jnp.float32(0), jnp.float32(0), zero_aux)
        steps = jnp.arange(grad_accum_steps)
        (g_sum, l_sum, n_sum, a_sum), _ = jax.lax.scan(micro_step, carry0, (steps, batch, mask))
        g_sum = strategy.reduce_grads(g_sum, param_specs)
        l_sum, n_sum, a_sum = jax.lax.psum((l_sum, n_sum, a_sum), AXIS)
        return g_sum, l_sum, n_sum, a_sum

    def step(state: TrainState, window: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        batch, mask = window.batch, window.mask
        params_c = policy.cast_to_compute(state.params)  # once per window, outside the scan
        rng, key = jax.random.split(state.rng)
        scale = state.loss_scale.scale
        batch_specs = jax.tree.map(lambda _: P(None, AXIS), batch)
        item_mode = is_item_mode(loss_fn, params_c, window)  # static: fixed at trace time
        g_sum, l_sum, n_sum, a_sum = jax.shard_map(
            partial(local_window, item_mode=item_mode), mesh=strategy.mesh,
            in_specs=(param_specs, batch_specs, P(), P(), P()),
            out_specs=(param_specs, P(), P(), P()),
            check_vma=False,
        )(params_c, batch, mask, key, scale)
        valid = jnp.sum(mask.astype(jnp.float32))
        micro_steps = valid * num_devices
        rows = jax.tree.leaves(batch)[0].shape[1]  # global rows of one micro-batch
        divisor = n_sum if item_mode else micro_steps
        grads = jax.tree.map(lambda g: g / (divisor * scale), g_sum)
        found_inf = jnp.asarray(False)
        if scaled:  # after an overflow at the floor, stop stepping (raised when checked)
            found_inf = ~_all_finite(grads) | state.loss_scale.floor_hit
        grad_norm = optax.tree.norm(grads)
        if clip_norm is not None:
            # torch.nn.utils.clip_grad_norm_'s coefficient, so both backends clip alike.
            coef = jnp.minimum(clip_norm / (grad_norm + 1e-6), 1.0)
            grads = jax.tree.map(lambda g: g * coef, grads)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        if scaled:  # only fp16 can skip; elsewhere the select would cost a copy of the state
            keep = lambda new, old: jnp.where(found_inf, old, new)  # noqa: E731
            params = jax.tree.map(keep, params, state.params)
            opt_state = jax.tree.map(keep, opt_state, state.opt_state)
        loss_scale = scaler.update(state.loss_scale, found_inf)
        new_state = TrainState(params=params, opt_state=opt_state, loss_scale=loss_scale,
                               step=state.step + (~found_inf).astype(state.step.dtype), rng=rng)
        metrics = {
            "loss": l_sum / divisor,
            "num_items": n_sum if item_mode else valid * rows,
            "grad_norm": grad_norm,
            "loss_scale": loss_scale.scale,
            "skipped": found_inf,
        }
        if jax.tree.leaves(a_sum):
            metrics["aux"] = jax.tree.map(lambda a: a / micro_steps, a_sum)
        return new_state, metrics

    metric_sharding = strategy.sharding(P())
    return jax.jit(step, donate_argnums=0,
                   out_shardings=(state_shardings, metric_sharding))


def _all_finite(tree: Any) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def build_eval(loss_fn: LossFn, *, strategy: JaxStrategy, policy: JaxPolicy,
               state_shardings: TrainState) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """The jitted ``(state, batch, weight) -> (loss_sum, num_items)`` of one evaluation batch.

    ``batch`` leaves are ``[rows, ...]`` sharded over the data axis and ``weight`` is ``[rows]``
    (one value per process: 0 for a process that ran out of batches and repeats its last one,
    so every process runs the same number of collective calls). Mean-mode losses count as
    ``mean x rows``.
    """
    param_specs = jax.tree.map(lambda s: s.spec, state_shardings.params)

    def local(params_c: Any, batch: Any, weight: jax.Array) -> tuple[jax.Array, jax.Array]:
        full = strategy.gather_params(params_c, param_specs)
        loss, items, _ = split_loss_output(loss_fn(full, batch, None))
        rows = jax.tree.leaves(batch)[0].shape[0]
        if items is None:  # a mean over this device's rows
            loss, items = loss * rows, rows
        w = weight[0]
        sums = (loss.astype(jnp.float32) * w, jnp.asarray(items, jnp.float32) * w)
        return jax.lax.psum(sums, AXIS)

    def evaluate(state: TrainState, batch: Any, weight: jax.Array) -> tuple[jax.Array, ...]:
        params_c = policy.cast_to_compute(state.params)
        specs = jax.tree.map(lambda _: P(AXIS), batch)
        return jax.shard_map(local, mesh=strategy.mesh, in_specs=(param_specs, specs, P(AXIS)),
                             out_specs=(P(), P()), check_vma=False)(params_c, batch, weight)

    return jax.jit(evaluate)
