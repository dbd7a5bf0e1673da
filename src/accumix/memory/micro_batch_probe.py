"""``micro_batch_size="auto"`` on torch: probe the set-up model, agree across ranks, choose.

Each candidate size n (``micro_batch_search.candidates``: the divisors of G / world, so K is an
integer) is probed by bisection. One probe runs on every rank, under the real strategy and
precision, the *steady state* of a window of K = G / (world * n) micro-steps, which training
reaches from its second micro-step on:

* the optimizers' states are alive: an optimizer with no state yet (the one holding this rank's
  states, ``Strategy.state_optimizer``: ZeRO-1's local partition) is copied with ``lr=0`` over
  the same parameters and stepped, so its states are allocated and held through the probe while
  the real optimizer stays untouched (one with state already is part of the baseline;
  ``shadow_optimizers``);
* two micro-steps run: the user's step (forward + loss) on ``make_batch(n)``, the longest batch
  the data can give, under the precision's autocast, and its backward (scaled as fp16 scales
  it) with gradient communication off, as off the boundary. With K > 1 the second runs while
  the first one's gradients are held, as the window's accumulators (under FSDP the unsharded
  ones): the peak counts states, accumulators and one micro-step's activations at once. With
  K = 1 the gradients are dropped between them, as ``zero_grad`` does. The output the step
  returned stays alive until the next step has returned (a loop's ``out = step(batch)``);
* the window's end: the copies step again, with the window's gradients, the states and the
  last output alive (the step's temporaries).

With K = 1 no gradient is held through a forward, so the largest size (K = 1) may fit where
smaller ones do not: it is tried on its own (``largest_fitting(top_alone=True)``).

On CPU, which has no out-of-memory error before the kernel's OOM killer, the two smallest
sizes that run are probed first (a BatchNorm model refuses 1 row: then 2 and 3) and a size
their peaks predict at twice its budget is not run. The probe's own host copy of the
parameters is not counted: a training run never holds it.

**Agreement without a hang.** The decision is the minimum over ranks: one ``all_gather`` of
``[failed, peak, limit]`` per probe. An out-of-memory error on one rank must not leave the
others inside a collective it will never join (FSDP all-gathers in forward and backward; DDP
broadcasts buffers before its forward). So every place the backend may communicate is preceded
by a *checkpoint*, the same gather of ``[0, 0, 0]``: a forward pre-hook (run before the
strategy's own) and a hook on the outputs' gradients (run before the strategy's pre-backward) of
each unit that communicates (``Strategy.probe_units``), and one before the backward. A rank
that fails stops and makes exactly one more gather, ``[1, 0, 0]`` (``[2, 0, 0]`` for an error
other than out-of-memory, which is then raised on every rank); the other ranks meet it at
their next checkpoint, see the flag and stop there too. Every rank so makes the same number of
gathers, and no backend collective is ever started on one rank alone. (DeepSpeed reduces
from hooks inside its backward, out of reach of a checkpoint: ``Strategy.probe_mode`` and
``probe_backward`` run its probe beside the engine, with no collective in the backward,
``strategies/deepspeed_probe``.)

**Probing changes nothing.** Parameters and buffers (this rank's shards), and the parameters the
optimizers step outside the set-up models (a learnable loss temperature), are copied to the
host once before the search and copied back after it (a buffer the forward replaced by a new
tensor is put back in its module); every RNG stream (python, numpy, torch,
CUDA) is captured and restored; gradients the probe made are dropped
(``Strategy.clear_gradients``, and on those outside parameters);
the loss scale is read, never updated; the accumulation window and the loaders are not touched
(the loader is set up after the choice). An ``auto`` run is therefore bit-identical to the run
given the chosen size.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

import torch

from accumix.checkpoint import rng_state
from accumix.common.micro_batch_search import (
    DEFAULT_HEADROOM,
    MicroBatchChoice,
    candidates,
    check_headroom,
    fits_with_headroom,
    is_auto,
    largest_fitting,
)
from accumix.data.loader import move_to_device
from accumix.errors import AccumixError, ConfigError
from accumix.memory.micro_batch_agreement import (
    ERROR,
    OOM,
    Agreement,
    PeerFailed,
    ProbeError,
    checkpoint_hooks,
)
from accumix.memory.micro_batch_cache import cache_key, outside_parameters, read_cache, write_cache
from accumix.memory.peak_memory import PeakMeter, release_cached
from accumix.memory.probe_batch import MakeBatch
from accumix.memory.probe_batch import batch_maker as batch_maker  # its home before
from accumix.memory.probe_batch import sample_elements as sample_elements
from accumix.memory.shadow_optimizers import ShadowOptimizers
from accumix.step import accum_steps

if TYPE_CHECKING:
    from accumix.step.run_state import RunState

log = logging.getLogger("accumix")

StepFn = Callable[[Any], Any]


def find_micro_batch_size(run: RunState, step: StepFn, make_batch: MakeBatch, *,
                          headroom: float, run_dir: str | os.PathLike[str] | None) -> int:
    """``Accelerator.find_micro_batch_size``: chooses, then gives ``acc`` the micro-batch and
    the K that follows (the window, the strategy's batch geometry, what loaders get)."""
    steps, global_batch, micro = run.batch_sizes
    if not is_auto(micro) or run.micro_batch_choice is not None or not run.models:
        raise ConfigError(f"find_micro_batch_size needs micro_batch_size='auto' (got "
                          f"{micro!r}), called once, after acc.setup(model, optimizer)")
    if steps is not None:
        raise ConfigError(f"grad_accum_steps={steps} with micro_batch_size='auto': K follows "
                          "from the chosen size; give global_batch_size only")
    choice = choose_micro_batch(run, step, make_batch, headroom=headroom, run_dir=run_dir)
    run.micro_batch_choice = choice
    run.batch_sizes = (steps, global_batch, choice.micro_batch_size)
    run.window.grad_accum_steps = accum_steps.derive(run, choice.micro_batch_size) or 1
    run.steps_known = True
    run.strategy.set_batch_geometry(micro_batch_size=choice.micro_batch_size,
                                    grad_accum_steps=run.grad_accum_steps)
    return choice.micro_batch_size


def choose_micro_batch(run: RunState, step: StepFn, make_batch: MakeBatch, *,
                       headroom: float = DEFAULT_HEADROOM,
                       run_dir: str | os.PathLike[str] | None = None) -> MicroBatchChoice:
    """The largest candidate micro-batch that fits on every rank (collective).

    Args:
        acc: the Accelerator, its models and optimizers set up.
        step: ``step(batch) -> loss`` (or ``(loss_sum, num_items)``, or an object with ``.loss``).
        make_batch: ``make_batch(n)``: a batch of n rows, the longest the data can give.
        headroom: the fraction of the limit left free.
        run_dir: where the answer is cached, keyed by what it depends on; None: no cache.

    Raises:
        ConfigError: not even a micro-batch of 1 fits, or a bad ``headroom``.
    """
    check_headroom(headroom)
    _, global_batch, _ = run.batch_sizes
    world = run.strategy.dp_world_size
    sizes = candidates(global_batch, world)
    for model in run.models:  # a strategy that cannot be probed refuses here, on every rank
        run.strategy.probe_units(model)
    rng = rng_state.capture(run)  # make_batch and the probes may draw: restored at the end
    try:
        return _choose(run, step, make_batch, sizes, headroom, run_dir)
    finally:
        rng_state.restore(run, rng)


def _choose(run: RunState, step: StepFn, make_batch: MakeBatch, sizes: list[int],
            headroom: float, run_dir: str | os.PathLike[str] | None) -> MicroBatchChoice:
    _, global_batch, _ = run.batch_sizes
    world, limit = run.strategy.dp_world_size, run.memory_limit
    key = cache_key(run, make_batch(1), global_batch, headroom)
    cached = read_cache(run_dir, key)
    agreed = run.strategy.all_gather(torch.tensor([cached or 0], device=run.device))
    if all(int(t.item()) in sizes for t in agreed) and len({int(t.item()) for t in agreed}) == 1:
        micro = int(agreed[0].item())
        choice = MicroBatchChoice(micro_batch_size=micro, grad_accum_steps=global_batch // (
            micro * world), dp_world_size=world, global_batch_size=global_batch,
            peak_bytes=0, limit_bytes=limit, tightest_rank=0, probes=0)
        log.info("%s (cached in %s)", choice.describe().split(":")[0], run_dir)
        return choice
    results: dict[int, list[list[float]]] = {}
    verdicts: dict[int, bool] = {}
    raised: dict[int, str] = {}  # sizes whose step raised (BatchNorm refusing 1 row)

    def fits(n: int, tolerate: bool = False) -> bool:
        if n not in verdicts:
            smallest = next((m for m in sizes if m not in raised), None)
            # Memory grows with the rows among sizes with K > 1; K = 1 holds no accumulator.
            if (n != sizes[-1] and verdicts.get(smallest) is False) \
                    or _far_over(results, n, headroom):
                verdicts[n] = False
            else:
                meter = PeakMeter(run.device, exclude=kept)
                rows = _probe(run, step, make_batch, n, limit, meter, tolerate=tolerate)
                if rows is not None:
                    results[n] = rows
                verdicts[n] = rows is not None and all(
                    fits_with_headroom(int(peak), int(lim), headroom) for _, peak, lim in rows)
        return verdicts[n]

    with _parameters_preserved(run) as kept:
        if run.device.type == "cpu":
            # No out-of-memory error on CPU before the kernel kills the process: the two
            # smallest sizes that run give each rank's bytes per row, and a size predicted far
            # past the limit is not run (``_far_over``). A size whose step raises is left out
            # (BatchNorm refuses 1 row); after two such, the model's own error is raised.
            for n in sizes:
                if len(results) == 2:
                    break
                try:
                    fits(n, tolerate=len(raised) < 2)
                except ProbeError as exc:  # no prediction from n; the search goes on without it
                    raised[n] = str(exc)
                    continue
                if n not in results:  # a rank ran out of memory: no larger K > 1 size runs
                    break
        runnable = [n for n in sizes if n not in raised]
        best, _ = largest_fitting(runnable, fits, top_alone=True) if runnable else (None, 0)
    probes = len(results)
    if best is None:
        smallest = runnable[0] if runnable else sizes[0]
        detail = (f"peak {results[smallest]} [failed, peak, limit] per rank"
                  if smallest in results else "a rank ran out of memory")
        detail += "".join(f"; {n} row(s) raised {message}" for n, message in raised.items())
        raise ConfigError(f"micro_batch_size='auto': not even a micro-batch of {smallest} fits "
                          f"in memory_limit={limit} bytes with headroom {headroom} ({detail}); "
                          "use a larger memory_limit, a sharding strategy (fsdp) or a smaller "
                          "model")
    rows = results[best]
    tightest = max(range(len(rows)), key=lambda r: rows[r][1] / max(rows[r][2], 1))
    choice = MicroBatchChoice(
        micro_batch_size=best, grad_accum_steps=global_batch // (best * world),
        dp_world_size=world, global_batch_size=global_batch, peak_bytes=int(rows[tightest][1]),
        limit_bytes=int(rows[tightest][2]), tightest_rank=tightest, probes=probes)
    log.info(choice.describe())
    if run.is_main_process:
        write_cache(run_dir, key, best)
    return choice


def measure(run: RunState, step: StepFn, make_batch: MakeBatch, n: int) -> PeakMeter | None:
    """One probe of size n (collective), state restored: this rank's meter (``peak``, and
    ``growth`` above the bytes alive before), or None when some rank ran out of memory."""
    rng = rng_state.capture(run)
    try:
        with _parameters_preserved(run) as kept:
            meter = PeakMeter(run.device, exclude=kept)
            rows = _probe(run, step, make_batch, n, run.memory_limit, meter)
    finally:
        rng_state.restore(run, rng)
    return None if rows is None else meter


def _far_over(results: dict[int, list[list[float]]], n: int, headroom: float) -> bool:
    """Whether size n is predicted, on some rank, at twice its budget or more: the peak is
    affine in the rows, fitted through the two smallest probed sizes' peaks (gathered, so every
    rank predicts the same and they skip the same probes)."""
    if len(results) < 2:
        return False
    a, b = sorted(results)[:2]
    for low, high in zip(results[a], results[b], strict=True):
        per_row = max(high[1] - low[1], 0.0) / (b - a)
        if low[1] + (n - a) * per_row > 2 * low[2] * (1 - headroom):
            return True
    return False


def _probe(run: RunState, step: StepFn, make_batch: MakeBatch, n: int, limit: int,
           meter: PeakMeter, tolerate: bool = False) -> list[list[float]] | None:
    """One probe of size n on every rank: each rank's ``[0, peak, limit]``, or None when a rank
    ran out of memory (then every rank returns None, having made the same collectives).

    Raises:
        ProbeError: ``tolerate`` and a rank's step raised another error (on every rank).
    """
    _, global_batch, _ = run.batch_sizes
    accumulating = global_batch // (run.strategy.dp_world_size * n) > 1
    agreement = Agreement(run)
    failed = 0.0
    rows = None
    error: Exception | None = None
    said = "an error on another rank"  # what a tolerant probe's ProbeError says
    try:
        with checkpoint_hooks(run, agreement), meter.measure():
            _steady_state(run, step, make_batch(n), agreement, accumulating)
        rows = agreement.final(meter.peak, limit)
    except torch.OutOfMemoryError:
        failed = OOM
    except PeerFailed:
        pass
    except Exception as exc:  # the user's error: every rank stops at the same gather first
        failed, error = ERROR, None if tolerate else exc
        said = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    finally:
        _clear_gradients(run)
    release_cached(run.device)  # outside the handler: its traceback (and tensors) is gone
    if failed:
        agreement.fail(failed)
    if agreement.kind == ERROR:
        if tolerate:
            raise ProbeError(said)
        if error is not None:
            raise error
        raise AccumixError(f"micro_batch_size='auto': another rank's step raised while probing "
                           f"{n} rows; its error is in its log")
    return rows


def _steady_state(run: RunState, step: StepFn, batch: Any, agreement: Agreement,
                  accumulating: bool) -> None:
    """The optimizers' states, two micro-steps (their gradients held between them when the
    window accumulates) and the window's end (module docstring)."""
    batch = move_to_device(batch, run.device)
    states = ShadowOptimizers(run)  # allocated now: alive through both micro-steps
    with ExitStack() as no_sync:
        for model in run.models:
            no_sync.enter_context(run.strategy.probe_mode(model))
        try:
            held = None
            for index in range(2):
                output = step(batch)
                held = None  # the previous micro-step's output lived through this forward
                loss = _loss_of(output)
                agreement.checkpoint()  # the backward may communicate (FSDP all-gathers)
                scale = run.strategy.scaler.scale
                run.strategy.probe_backward(loss * scale if scale != 1.0 else loss,
                                            run.models[0] if run.models else None)
                del loss
                held, output = output, None
                if index == 0 and not accumulating:  # K = 1: the window ends, zero_grad
                    states.step()
                    _clear_gradients(run)
            states.step()  # the window's end, its gradients and the last output alive
            del held
        finally:  # still without gradient sync: a stopped backward's cleanup must not talk
            _clear_gradients(run)
            states.shadows.clear()


def _clear_gradients(run: RunState) -> None:
    """Drops every gradient a probe made: the models' (``Strategy.clear_gradients``) and those
    of parameters the optimizers step outside them."""
    for model in run.models:
        run.strategy.clear_gradients(model)
    for param in outside_parameters(run):
        param.grad = None


@contextmanager
def _parameters_preserved(run: RunState) -> Iterator[list[torch.Tensor]]:
    """Restores every parameter and buffer (this rank's shards) and every parameter the
    optimizers step outside the models after the search, and the gradients that existed
    before it (a window in progress): the probe's backward adds into them and its cleanup
    drops them, so each comes back as the same tensor with its values. A buffer the forward
    *replaced* (``self.mean = 0.9 * self.mean + ...``, a running normaliser) is put back in its
    module too: restoring the old tensor's values alone would leave the probe's in the model
    (parameters are left to the strategy: FSDP2 swaps them in its own forward). Yields what
    a meter must not count: these host copies, and those gradients (the probe makes its own)."""
    outside = outside_parameters(run)
    tensors = [t for model in run.models
               for t in (*model.parameters(), *model.buffers())] + outside
    slots = [(module, name, tensor) for model in run.models for module in model.modules()
             for name, tensor in module._buffers.items() if tensor is not None]
    saved = [_local(t.detach()).to("cpu", copy=True) for t in tensors]
    params = list(dict.fromkeys(
        [p for model in run.models for p in model.parameters()] + outside))
    grads = [(p, p.grad, _local(p.grad.detach()).to("cpu", copy=True))
             for p in params if p.grad is not None]
    try:
        yield saved + [copy for _, _, copy in grads] + [grad for _, grad, _ in grads]
    finally:
        with torch.no_grad():
            for module, name, tensor in slots:
                if module._buffers.get(name) is not tensor:
                    module._buffers[name] = tensor
            for tensor, copy in zip(tensors, saved, strict=True):
                _local(tensor.detach()).copy_(copy)
            for param, grad, copy in grads:
                _local(grad).copy_(copy)
                param.grad = grad


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _loss_of(output: Any) -> torch.Tensor:
    if isinstance(output, (tuple, list)):
        output = output[0]
    loss = getattr(output, "loss", output)
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(f"the probe's step returned {type(output).__name__}; return the loss "
                          "tensor, (loss_sum, num_items) or an object with .loss")
    return loss
