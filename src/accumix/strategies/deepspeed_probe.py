"""``micro_batch_size="auto"`` under DeepSpeed (0.19): a probe micro-step that starts no
collective a rank which ran out of memory would miss (``micro_batch_probe``'s protocol).

The engine's own path cannot be probed so: ZeRO-2 reduce-scatters gradient buckets from
hooks *inside* the backward and runs its epilogue's reduction at the end of it, so an
out-of-memory error mid-backward on one rank leaves the others in a collective. The probe
therefore runs the micro-step beside the engine's machinery, on the same module, parameters
and precision:

* forward: the engine's module is called directly (the engine's ``forward`` would register
  its output backward hooks, whose prologue enters ZeRO's backward state); the engine's own
  forward hooks still run (rank 0's BatchNorm buffers are broadcast after the forward, which
  the probe's checkpoint precedes). ZeRO 1 and 2 hold whole parameters: the forward itself
  does not communicate.
* backward: the plain ``loss.backward()`` with ZeRO's gradient hooks taken off the
  parameters meanwhile (``zero_hooks_off``), so its bucket reduction and epilogue never fire:
  the engine's counters (``micro_steps``, ``global_steps``, the optimizer's ``micro_step_id``),
  its gradient partitions and buckets, and the loss scale are untouched. Every gradient is
  computed at its full size into ``.grad`` (what ZeRO-1 holds; ZeRO-2 would free each bucket
  after reducing it, so the probe errs on the safe side), then dropped. A plain backward, not
  ``torch.autograd.grad``: a model with reentrant activation checkpointing (``use_reentrant=
  True``, the default of many Hugging Face models) refuses ``.grad()`` and the probe failed
  where the run works. Where the hooks cannot be found (another DeepSpeed), the gradients are
  taken by ``torch.autograd.grad``, which runs no hook either. The reduction buckets those
  hooks would allocate (``reduce_bucket_size`` elements each) are allocated beside it, so the
  peak counts them.

ZeRO-3 partitions the parameters: its forward and backward all-gather them from module hooks
(prefetching the next modules' ahead of time), which no checkpoint can precede, so stage 3 is
refused with a line saying what works.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from accumix.errors import ConfigError


def check_probeable(stage: int) -> None:
    """Raises ``ConfigError`` for the ZeRO stage the probe cannot run safely (3)."""
    if stage == 3:
        raise ConfigError("micro_batch_size='auto' does not probe DeepSpeedStrategy(stage=3) "
                          "(its parameter all-gathers run inside module hooks); use stage=1 or "
                          "2, strategy='fsdp', or give micro_batch_size=N")


@contextmanager
def module_forward(engine: Any) -> Iterator[None]:
    """While probing, calling the engine runs its module directly (and the engine's hooks)."""
    module = engine.module
    engine.forward = lambda *args, **kwargs: module(*args, **kwargs)
    try:
        yield
    finally:
        del engine.forward


def probe_backward(loss: torch.Tensor, engine: Any) -> None:
    """The probe's backward: every gradient computed into ``.grad`` (dropped by the caller),
    no hook of ZeRO's; the reduction buckets ZeRO's first hook would allocate are held
    meanwhile."""
    params = [p for p in engine.module.parameters() if p.requires_grad]
    buckets = reduction_buckets(engine, params[0].device if params else torch.device("cpu"))
    with zero_hooks_off(engine.optimizer) as off:
        if off:
            loss.backward()
        else:
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            del grads
    del buckets


@contextmanager
def zero_hooks_off(optimizer: Any) -> Iterator[bool]:
    """Takes ZeRO 1/2's post-accumulate gradient hooks (``_grad_acc_hooks``: the handles of
    ``register_post_accumulate_grad_hook``) off their parameters and puts the same functions
    back under the same keys afterwards; yields whether they could be taken off (False: a
    DeepSpeed whose hooks are not where 0.19 keeps them)."""
    handles = getattr(optimizer, "_grad_acc_hooks", None)
    if not isinstance(handles, list) or not all(
            hasattr(h, "hooks_dict_ref") and hasattr(h, "id") for h in handles):
        yield False
        return
    taken = []
    for handle in handles:
        hooks = handle.hooks_dict_ref()
        if hooks is not None and handle.id in hooks:
            taken.append((hooks, handle.id, hooks.pop(handle.id)))
    try:
        yield True
    finally:
        for hooks, key, hook in taken:
            hooks[key] = hook


def reduction_buckets(engine: Any, device: torch.device) -> list[torch.Tensor]:
    """What ZeRO 1/2's first gradient hook of a window allocates (``setup_buckets``, freed
    after each step): one ``reduce_bucket_size`` buffer per communication dtype, two with
    ``overlap_comm`` (DeepSpeed's default size, 5e8 elements, is 1 GB in bf16). The probe runs
    none of ZeRO's hooks, so it holds buffers of the same size instead; none when the window
    in progress has them already. On CPU only what the hooks write counts
    (``bucket_elements``)."""
    optimizer = engine.optimizer
    if not getattr(optimizer, "contiguous_gradients", False) or getattr(
            optimizer, "ready_for_gradients", True) or not hasattr(optimizer, "ipg_buckets"):
        return []
    dtype = optimizer._gradient_reduction_buffer_dtype()
    trainable = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    sizes = bucket_elements(int(optimizer.reduce_bucket_size), trainable,
                            overlap_comm=bool(getattr(optimizer, "overlap_comm", False)),
                            resident_when_written=device.type == "cpu")
    return [torch.empty(size, dtype=dtype, device=device)
            for _ in optimizer.ipg_buckets for size in sizes]


def bucket_elements(bucket: int, trainable: int, *, overlap_comm: bool,
                    resident_when_written: bool) -> list[int]:
    """The elements each of one communication dtype's reduction buffers occupies.

    A GPU's caching allocator holds the whole ``torch.empty`` of ``bucket`` elements. On CPU a
    buffer this large is mapped, not resident: a page becomes memory when written, and the hooks
    write at most the trainable gradients into it (a bucket is reduced and refilled from 0 when
    full), so at most ``min(bucket, trainable)`` elements of it ever count; the second buffer
    of ``overlap_comm`` is written only once a first bucket was full (ZeRO-2 on one process,
    bf16, 5e8-element buckets, a 400-parameter model: the process's resident memory grew 5 MB
    in the first backward, not the 1 GB the whole buffer would be)."""
    if not resident_when_written:
        return [bucket] * (2 if overlap_comm else 1)
    written = min(bucket, trainable)
    return [written, written] if overlap_comm and trainable > bucket else [written]


def follow_choice(engine: Any, micro_batch_size: int, grad_accum_steps: int) -> None:
    """The engine was configured before ``auto`` chose (micro-batch 1): its batch bookkeeping
    (``global_samples``, what its monitors and schedulers read) takes the chosen geometry."""
    engine.set_train_micro_batch_size(micro_batch_size)
    engine.set_train_batch_size(micro_batch_size * grad_accum_steps * engine.dp_world_size)
