"""The window step: K micro-steps, one gradient reduction, one optimizer update, one jit.

    params_c = cast(params)                      # once per window, outside the scan
    shard_map over the "data" axis (each device its rows and its column of the mask):
        scan over the K micro-batches:           # skipped where no device has one (a cond
                                                 #   on a global flag: the same collectives)
            g_i = grad(scale * loss_i * valid)   # float leaves only; integer leaves, keys carried;
                                                 #   a padded device: its micro-batch 0, seed 0
            acc += float32(g_i)                  # (complex64 for complex params); item mode in
                                                 #   fp16: scale * loss_sum_i / n_i, then x n_i
                                                 #   (fsdp: gathered at each use, and the backward
                                                 #   adds into acc itself, accumix.jax.gather)
                                                 # 16-bit wire: x n_i / N instead (item mode, N
                                                 #   counted before the scan) or x 1 / M (mean
                                                 #   mode): acc holds its share of the mean
        grads = psum | psum_scatter(acc)         # ONE reduction per window, after the scan
    grads /= scale * (N items | valid micro-steps over devices)   # one division, at the end
                                                 # (no items: zero gradients, not 0/0; a 16-bit
                                                 #   wire: / scale only, accumix.jax.wire)
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

from accumix.jax import trainable
from accumix.jax.loss_output import LossForm, read_form
from accumix.jax.loss_scale import LossScaleRule
from accumix.jax.precision import JaxPolicy
from accumix.jax.state import TrainState
from accumix.jax.strategies import JaxStrategy
from accumix.jax.trainable import accum_dtype

LossFn = Callable[[Any, Any, jax.Array], Any]


def loss_form(loss_fn: LossFn, params: Any, window: Any, devices: int) -> LossForm:
    """How ``loss_fn``'s result reads (traced once, abstractly, on what the step hands it: one
    micro-batch's rows of one of the window's ``devices``; the whole window's rows would break a
    ``loss_fn`` that relies on its row count, a reshape to one device's batch)."""
    micro = jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[1] // devices, *x.shape[2:]),
                                                        x.dtype), window.batch)
    return read_form(loss_fn, params, micro, jax.random.key(0))


def is_item_mode(loss_fn: LossFn, params: Any, window: Any, devices: int) -> bool:
    """Whether ``loss_fn`` returns an item count (item-weighted accumulation)."""
    return loss_form(loss_fn, params, window, devices).item_mode


def count_dtype(items: Any) -> Any:
    """The window's item count: integer counts stay integers (exact past 2**24, where float32
    rounds); fractional weights sum in float32."""
    dtype = getattr(items, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jnp.integer):
        return jax.dtypes.canonicalize_dtype(jnp.int64)
    return jnp.float32


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
    normalise = strategy.wire.narrow  # a 16-bit wire carries the window's mean, not its sum

    def local_window(params_c: Any, batch: Any, mask: jax.Array, key: jax.Array,
                     scale: jax.Array, *, form: LossForm, train_specs: Any) -> tuple[Any, ...]:
        """One device's K micro-steps; returns the reduced sums."""
        axes = strategy.data_axes
        device = jax.lax.axis_index(axes)
        first = jax.tree.map(lambda x: x[0], batch)
        # Integer leaves and keys take no gradient: gathered plainly (never through the
        # strategy's differentiated gather) and merged back around the float leaves.
        carried = jax.tree.map(
            lambda x, spec: x if trainable.is_trainable(x) else strategy.gather_params(x, spec),
            params_c, param_specs)
        weights = trainable.select(params_c, params_c)
        target = strategy.grad_target(weights, train_specs)  # what each micro-step differentiates
        one = jnp.float32(1)

        def use(shards: Any, t: Any, weight: jax.Array, rest: Any = carried) -> Any:
            return trainable.merge(strategy.params_at_use(shards, t, train_specs, weight), rest)

        shapes = jax.eval_shape(lambda w, t: use(w, t, one), weights, target)
        _, items0, aux0 = form.split(jax.eval_shape(loss_fn, shapes, first, key))
        item_mode, n_dtype = form.item_mode, count_dtype(items0)
        # fp16 item mode divides each device's gradient by its own item count (below); a
        # strategy that sums devices inside the backward must multiply it back there first.
        absolute = strategy.accumulates_in_backward  # the taps' cotangent: the accumulator
        weigh_in_backward = scaled and item_mode and (strategy.reduces_each_microstep
                                                      or absolute)
        steps = jnp.arange(grad_accum_steps)
        mask = mask[:, 0]  # this device's column: processes may pass windows of other lengths
        valid_devices = jax.lax.psum(mask.astype(jnp.int32), axes)  # per micro-step, global

        def micro_key(index: jax.Array) -> jax.Array:
            return jax.random.fold_in(jax.random.fold_in(key, index), device)

        def real(given: Any, valid: jax.Array) -> Any:
            """The micro-batch, or (padding) this device's micro-batch 0 (see ``compute``)."""
            return jax.tree.map(lambda x, x0: jnp.where(valid, x, x0), given, first)

        # A 16-bit wire carries normalised gradients (accumix.jax.wire): each micro-step's
        # gradient joins the accumulator times its share of the window's mean, which needs the
        # window's total before the first micro-step: item mode counts every micro-step's
        # items first (the count alone: XLA drops the rest of that forward).
        shares = None
        if normalise and item_mode:
            def count(xs: tuple[Any, ...]) -> jax.Array:
                index, given, valid = xs
                k = micro_key(index)
                items = form.split(loss_fn(use(weights, target, one,
                                               trainable.reseeded(carried, k)),
                                           real(given, valid), k))[1]
                return jnp.where(valid, jnp.asarray(items, n_dtype), jnp.zeros((), n_dtype))
            counts = jax.lax.map(count, (steps, batch, mask))
            total = jax.lax.psum(jnp.sum(counts), axes).astype(jnp.float32)
            own = jnp.maximum(counts, 1).astype(jnp.float32) if scaled else jnp.ones(
                counts.shape, jnp.float32)  # what undoes the objective's division by n_i
            shares = own / jnp.maximum(total, 1.0)
        elif normalise:  # mean mode: 1 / the valid (device, micro-step) pairs
            shares = jnp.broadcast_to(1.0 / jnp.maximum(jnp.sum(valid_devices), 1),
                                      (grad_accum_steps,)).astype(jnp.float32)

        def objective(p: Any, micro: Any, k: jax.Array, live: jax.Array
                      ) -> tuple[jax.Array, tuple[Any, ...]]:
            loss, items, aux = form.split(loss_fn(p, micro, k))
            loss = loss.astype(jnp.float32)
            items = jnp.asarray(items if item_mode else 1, n_dtype)
            # fp16 item mode: a summed loss x 65536 overflows; scale the sum by 1/n here and by
            # n in float32 below (the torch side divides by an items hint for the same reason).
            per = jnp.maximum(items, 1).astype(jnp.float32) if (scaled and item_mode) else 1.0
            return loss * (scale / per) * live, (loss, items, aux, per)

        zero_grads = jax.tree.map(lambda x: jnp.zeros(x.shape, accum_dtype(x.dtype)), target)
        zero_aux = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), aux0)

        def micro_step(carry: tuple[Any, ...], xs: tuple[Any, ...]) -> tuple[Any, None]:
            index, given, valid, anyone, *normalised = xs
            share = normalised[0] if normalise else one

            g_acc, l_acc, n_acc, a_acc = carry

            # The gradients are added into the accumulators inside the branch, leaf by leaf as
            # the backward yields them, not returned whole first (a second full set, alive).
            def compute(g_acc: Any) -> tuple[Any, ...]:
                k = micro_key(index)
                # A PRNG key held in the params (a flax nnx Rngs stream) draws anew here, as
                # ``k`` does: loss_fn cannot hand back the stream it advanced.
                rest = trainable.reseeded(carried, k)
                # A device whose micro-batch is padding (its process passed a shorter window)
                # runs this micro-step too when another device's is real: the collectives in
                # the backward (fsdp's gathers, sync's reduce-scatters) must be issued by every
                # device alike. It recomputes its own micro-batch 0 (always real: finite
                # wherever the real micro-step is, where zeros of padding could give 0/0) with
                # a zero loss seed, so every gradient it adds, before or after a sum over
                # devices, is exactly 0; the sums below select it away.
                live = valid.astype(jnp.float32)
                micro = real(given, valid)
                weight = one
                if normalise:  # this micro-step's share of the window's mean (counted above)
                    weight = share
                elif weigh_in_backward:  # the count alone: XLA drops the rest of this forward
                    items = form.split(loss_fn(use(weights, target, one, rest), micro, k))[1]
                    weight = jnp.maximum(jnp.asarray(items, jnp.float32), 1.0)

                def at_use(t: Any, shards: Any) -> tuple[jax.Array, tuple[Any, ...]]:
                    return strategy.call_at_use(
                        lambda p: objective(trainable.merge(p, rest), micro, k, live),
                        shards, t, train_specs, weight)

                grad, (loss, items, aux, per) = jax.grad(at_use, has_aux=True)(
                    g_acc if absolute else target, weights)

                factor = share if normalise else per

                def add(a: jax.Array, g: jax.Array) -> jax.Array:
                    if absolute:  # the new accumulator: a padded micro-step added its zeros
                        return g
                    g = g.astype(accum_dtype(g.dtype))
                    return a + jnp.where(valid, g * factor, 0)
                g_acc = jax.tree.map(add, g_acc, grad)
                aux = jax.tree.map(lambda a: jnp.where(valid, jnp.asarray(a, jnp.float32), 0),
                                   aux)
                return (g_acc, jnp.where(valid, loss, 0),
                        jnp.where(valid, items, jnp.zeros((), n_dtype)), aux)

            def skip(g_acc: Any) -> tuple[Any, ...]:
                return g_acc, jnp.float32(0), jnp.zeros((), n_dtype), zero_aux

            # The same predicate on every device (whether any device has this micro-step), so
            # that every device issues the same collectives: a short window's padded tail is
            # skipped where every process's window is short.
            g_acc, loss, items, aux = jax.lax.cond(anyone, compute, skip, g_acc)
            return (g_acc, l_acc + loss, n_acc + items,
                    jax.tree.map(jnp.add, a_acc, aux)), None

        carry0 = (zero_grads, jnp.float32(0), jnp.zeros((), n_dtype), zero_aux)
        xs = (steps, batch, mask, valid_devices > 0, *([] if shares is None else [shares]))
        (g_sum, l_sum, n_sum, a_sum), _ = jax.lax.scan(micro_step, carry0, xs)
        g_sum = strategy.reduce_grads(g_sum, train_specs)
        return g_sum, *jax.lax.psum((l_sum, n_sum, a_sum), axes), jnp.sum(valid_devices)

    def step(state: TrainState, window: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        batch, mask = window.batch, window.device_mask
        if mask is None:  # a Window built by hand: its mask holds for every device
            mask = jnp.broadcast_to(window.mask[:, None], (grad_accum_steps, num_devices))
        params_c = policy.cast_to_compute(state.params)  # once per window, outside the scan
        rng, key = jax.random.split(state.rng)
        scale = state.loss_scale.scale
        rows_spec = strategy.rows_spec(1)
        batch_specs = jax.tree.map(lambda _: rows_spec, batch)
        form = loss_form(loss_fn, params_c, window, num_devices)  # static: at trace time
        item_mode = form.item_mode
        train_specs = trainable.select(param_specs, state.params)
        g_sum, l_sum, n_sum, a_sum, micro_steps = jax.shard_map(
            partial(local_window, form=form, train_specs=train_specs), mesh=strategy.mesh,
            in_specs=(param_specs, batch_specs, rows_spec, P(), P()),
            out_specs=(train_specs, P(), P(), P(), P()),
            check_vma=False,
        )(params_c, batch, mask, key, scale)
        rows = jax.tree.leaves(batch)[0].shape[1] // num_devices  # one device's rows
        divisor = (n_sum if item_mode else micro_steps).astype(jnp.float32)
        # A window without items (all padding) has no mean: zero gradients, as on the torch side.
        has_items = divisor > 0
        divisor = jnp.where(has_items, divisor, 1.0)
        # A 16-bit wire's sums arrive normalised (each micro-step weighed by its share of the
        # window's mean): the loss scale is all that is left to divide by.
        normaliser = scale if normalise else divisor * scale
        grads = jax.tree.map(lambda g: jnp.where(has_items, g / normaliser, 0), g_sum)
        found_inf = jnp.asarray(False)
        if scaled:  # after an overflow at the floor, stop stepping (raised when checked)
            found_inf = ~_all_finite(grads) | state.loss_scale.floor_hit
        grad_norm = optax.tree.norm(grads)
        if clip_norm is not None:
            # torch.nn.utils.clip_grad_norm_'s coefficient, so both backends clip alike.
            coef = jnp.minimum(clip_norm / (grad_norm + 1e-6), 1.0)
            grads = jax.tree.map(lambda g: g * coef, grads)
        weights = trainable.select(state.params, state.params)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, weights)
        loss = l_sum / divisor
        updates, opt_state = optimizer.update(grads, state.opt_state, weights,
                                              **_extra_args(optimizer, loss))
        params = trainable.merge(optax.apply_updates(weights, updates), state.params)
        if scaled:  # only fp16 can skip; elsewhere the select would cost a copy of the state
            keep = lambda new, old: jnp.where(found_inf, old, new)  # noqa: E731
            params = jax.tree.map(keep, params, state.params)
            opt_state = jax.tree.map(keep, opt_state, state.opt_state)
        loss_scale = scaler.update(state.loss_scale, found_inf)
        new_state = TrainState(params=params, opt_state=opt_state, loss_scale=loss_scale,
                               step=state.step + (~found_inf).astype(state.step.dtype), rng=rng)
        metrics = {
            "loss": loss,
            "num_items": n_sum if item_mode else micro_steps * rows,
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


def _extra_args(optimizer: optax.GradientTransformation, loss: jax.Array) -> dict[str, Any]:
    """``value=`` (the window's loss) for optax transforms that read it (reduce_on_plateau):
    optax passes extra arguments through ``GradientTransformationExtraArgs`` only."""
    if isinstance(optimizer, optax.GradientTransformationExtraArgs):
        return {"value": loss}
    return {}


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

    def local(params_c: Any, batch: Any, weight: jax.Array, *,
              form: LossForm) -> tuple[jax.Array, jax.Array]:
        full = strategy.gather_params(params_c, param_specs)
        loss, items, _ = form.split(loss_fn(full, batch, None))
        rows = jax.tree.leaves(batch)[0].shape[0]
        if items is None:  # a mean over this device's rows
            loss, items = loss * rows, rows
        w = weight[0]
        sums = (loss.astype(jnp.float32) * w, jnp.asarray(items, jnp.float32) * w)
        return jax.lax.psum(sums, strategy.data_axes)

    def evaluate(state: TrainState, batch: Any, weight: jax.Array) -> tuple[jax.Array, ...]:
        params_c = policy.cast_to_compute(state.params)
        specs = jax.tree.map(lambda _: strategy.rows_spec(), batch)
        rows = jax.tree.map(  # one device's rows, as loss_fn sees them
            lambda x: jax.ShapeDtypeStruct((x.shape[0] // strategy.num_devices, *x.shape[1:]),
                                           x.dtype), batch)
        form = read_form(loss_fn, params_c, rows, None)
        return jax.shard_map(partial(local, form=form), mesh=strategy.mesh,
                             in_specs=(param_specs, specs, strategy.rows_spec()),
                             out_specs=(P(), P()), check_vma=False)(params_c, batch, weight)

    return jax.jit(evaluate)
