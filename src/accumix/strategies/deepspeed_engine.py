"""The DeepSpeed engine's internals that accumix reaches into, and the quirks it works around
(DeepSpeed 0.19): the boundary flag, where the gradient partitions live (and clipping them),
ZeRO-3's leftover partitions, the ZeRO loss-scale update order, the CPU comm kernel it need not
build, the process group it needs and the clone of it it caches, building the engine and
compiling it."""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from accumix.errors import ConfigError
from accumix.step.compile import Compiler, reporting_failures
from accumix.strategies.deepspeed_config import import_deepspeed


@contextlib.contextmanager
def off_boundary(engine: Any) -> Iterator[None]:
    """An off-boundary micro-step: the engine accumulates (stage 1 does not reduce); True is
    restored after it, so a window that ends early needs no counter of the engine's."""
    engine.set_gradient_accumulation_boundary(False)
    try:
        yield
    finally:
        engine.set_gradient_accumulation_boundary(True)


def partition_grads(optimizer: Any) -> list[torch.Tensor]:
    """The gradients a DeepSpeed optimizer will step with, this rank's partition only."""
    if getattr(optimizer, "cpu_offload", False) or getattr(optimizer, "offload_optimizer", False):
        raise ConfigError("zero_optimization.offload_optimizer is not supported by "
                          "strategy='deepspeed' in accumix; remove it from the config")
    if hasattr(optimizer, "averaged_gradients"):  # ZeRO 1/2 (DeepSpeedZeroOptimizer) and 3
        return [g for grads in optimizer.averaged_gradients.values() if grads is not None
                for g in grads if g is not None]
    if hasattr(optimizer, "fp32_groups_gradient_flat_partition"):  # BF16_Optimizer (stage 1)
        return list(optimizer.fp32_groups_gradient_flat_partition)
    raise ConfigError(f"strategy='deepspeed' does not know where {type(optimizer).__name__} "
                      "keeps its gradients; use ZeRO stage 1, 2 or 3 without offload")


def clear_stage3_grad_partitions(optimizer: Any) -> None:
    """Zeroes ZeRO-3's gradient partitions after a step, so the next window starts from zero.

    DeepSpeed's stage 3 (0.19.8, ``partition_grads``) copies a parameter's reduced gradient into
    its partition on the window's first micro-step (``micro_step_id == 0``) and adds to it on
    later ones, and never clears the partitions between windows: a parameter unused on the first
    micro-step (a conditional branch, an MoE expert) gets its later gradients added onto the
    previous window's. One memset of this rank's partition per window; a copy overwrites it
    anyway where the first micro-step reaches the parameter.
    """
    flat = getattr(optimizer, "grad_partitions_flat_buffer", None)
    if isinstance(flat, torch.Tensor):
        flat.zero_()


def skip_cpu_shm_build() -> None:
    # On the CPU accelerator DeepSpeed's comm layer JIT-compiles a shared-memory all-reduce
    # kernel (minutes on first use, needs a compiler) that only its inference all-reduce
    # uses; training reduces through torch.distributed, so mark it unavailable. DeepSpeed
    # keeps one dict of compatible ops for the process and reads it when it builds the op.
    from deepspeed import ops
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        ops.__compatible_ops__["deepspeed_shm_comm"] = False


def defer_scale_update(optimizer: Any) -> Callable[[], None]:
    """Moves a ZeRO optimizer's loss-scale update from inside its step to after it.

    DeepSpeed's ZeRO ``step`` (stages 1-3, 0.19) calls ``_update_scale`` before
    ``unscale_and_clip_grads``, which divides by the *updated* scale: on a step where the scale
    doubles, the optimizer gets half the gradient (and stage 3 reports half the norm). Nothing
    in the step after that call reads the new scale for the skip path, so the update is
    recorded there and applied once the step is done. Returns what applies it.
    """
    update = getattr(optimizer, "_update_scale", None)
    if update is None or not getattr(optimizer, "dynamic_loss_scale", False):
        return lambda: None
    pending: list[bool] = []
    optimizer._update_scale = pending.append  # the instance attribute shadows the method

    def apply() -> None:
        while pending:
            update(pending.pop(0))

    return apply


def ensure_process_group(device: torch.device, local_rank: int) -> bool:
    """A one-rank default group where none exists, and ``LOCAL_RANK`` set for DeepSpeed.

    Returns:
        Whether it created the group (its owner destroys it at teardown).
    """
    created = False
    # DeepSpeed's comm layer wraps torch.distributed's default group; one process launched
    # without torchrun has none, so a one-rank group on an in-memory store stands in.
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        created = True
    # DeepSpeed asserts LOCAL_RANK is set; accumix may have found it elsewhere (SLURM, MPI).
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    return created


class _Vouched(logging.Filter):
    """Drops DeepSpeed's "untested optimizer, proceed with caution" for an optimizer accumix
    checked (element-wise: exact on flat partitions), which its list does not name (SGD)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "untested optimizer" not in record.getMessage()


def initialize(model: nn.Module, optimizer: Optimizer, config: dict[str, Any],
               device: torch.device, *, vouched: bool = False) -> Any:
    """``deepspeed.initialize``'s engine; DeepSpeed's "fp16 is not supported" is a ConfigError.
    ``vouched``: accumix checked the optimizer, so DeepSpeed's warning about it is not shown."""
    deepspeed = import_deepspeed()
    ds_logger = logging.getLogger("DeepSpeed")
    quiet = _Vouched()
    if vouched:
        ds_logger.addFilter(quiet)
    try:
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                          config=config)
    except ValueError as exc:
        if "fp16 is not supported" in str(exc):
            raise ConfigError(
                f"precision='fp16-mixed' with strategy='deepspeed': DeepSpeed has no fp16 on "
                f"{device} ({exc}); use precision='bf16-mixed'"
            ) from exc
        raise
    finally:
        ds_logger.removeFilter(quiet)
    return engine


def compile_engine(engine: Any, compiler: Compiler) -> Any:
    """Through the engine's ``compile()`` (which compiles its module in place and tells the
    engine it is compiled); a model that came ``torch.compile``'d carries options that cannot
    be read back as keywords, so its own dynamo context compiles the engine's module the same
    way ``engine.compile`` would."""
    if compiler.options is None:
        compiler.compile_in_place(engine.module)
        return engine
    options = dict(compiler.options)
    engine.compile(backend=options.pop("backend", "inductor"), compile_kwargs=options)
    module = engine.module
    module._compiled_call_impl = reporting_failures(module._compiled_call_impl,
                                                    type(module).__name__)
    return engine


def clip_partitions_(grads: list[torch.Tensor], max_norm: float, norm_type: float, *,
                     all_reduce: Callable[[torch.Tensor, str], torch.Tensor],
                     loss_scale: float | None, device: torch.device) -> torch.Tensor:
    """The true norm of the still-scaled gradient partitions (all-reduced, divided by the loss
    scale); clips the partitions in place, so the engine's unscaling gives clipped gradients."""
    grads = [g.detach() for g in grads]
    device = grads[0].device if grads else device
    if math.isinf(norm_type):
        local = torch.stack([g.abs().max().float() for g in grads]).max() if grads else (
            torch.zeros((), device=device))
        total = all_reduce(local.reshape(1), "max")[0]
    else:
        local = sum((torch.linalg.vector_norm(g.float(), norm_type) ** norm_type
                     for g in grads), torch.zeros((), device=device))
        total = all_reduce(local.reshape(1), "sum")[0] ** (1.0 / norm_type)
    scale = loss_scale or 1.0
    norm = total / scale
    if grads:  # clipping the scaled partitions = clipping the true ones; no host sync
        coef = max_norm / (norm + 1e-6)
        # A NaN norm (fp16 overflow) leaves the partitions for the engine's own check.
        torch._foreach_mul_(grads, torch.where(coef < 1, coef, torch.ones_like(coef)))
    return norm


def release_group_references() -> None:
    """Drops DeepSpeed's per-process clone of the world group (after the engines are gone)."""
    # DeepSpeed caches a clone of the world group per process; the Accelerator may destroy
    # the world next, and an engine built later (a new Accelerator) must not use the stale
    # clone. deepspeed.comm.destroy_process_group does the same release.
    from deepspeed.utils import groups

    release = getattr(groups, "_release_process_group_references", None)
    if release is not None:
        release()
