"""Normalisation layers with running statistics (BatchNorm, tracking InstanceNorm) under the
backends that do not treat them as DDP does.

Two facts about such a layer shape this module:

* its running statistics are float32 buffers that its forward updates, so under a mixed
  precision that casts its weight to bf16 (FSDP2's ``MixedPrecisionPolicy``, DeepSpeed's bf16
  module) torch refuses the mixed call (``expected scalar type BFloat16 but found Float``).
  Under DDP autocast the weight stays float32 and the input comes in bf16; the sharded
  strategies are given the same: FSDP2 shards each such layer as its own float32 unit
  (``float32_norm_units``), DeepSpeed computes it from float32 copies of the engine's bf16
  weights (``float32_norm_forward``);
* DDP broadcasts rank 0's buffers at each forward, so every rank evaluates, exports and saves
  rank 0's statistics; FSDP2 and DeepSpeed leave each rank its own. ``agree_buffers_after_forward``
  broadcasts rank 0's buffers after each training forward of such a model: in training mode
  a norm layer normalises with the batch's statistics, so no forward reads the buffers between
  two agreements, and outside a forward every rank holds what DDP's would (rank 0's) with no
  collective in an evaluation forward (an uneven evaluation cannot hang on it).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.modules.batchnorm import _NormBase

Broadcast = Callable[[torch.Tensor], Any]


def running_stat_norms(model: nn.Module) -> list[nn.Module]:
    """The layers whose forward updates running statistics (BatchNorm, tracking InstanceNorm)."""
    return [m for m in model.modules()
            if isinstance(m, _NormBase) and m.track_running_stats]


def broadcast_buffers_(module: nn.Module, broadcast: Broadcast) -> None:
    """Overwrites every rank's buffers of ``module`` with rank 0's, one broadcast per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for buf in module.buffers():
        by_dtype.setdefault(buf.dtype, []).append(buf)
    for bufs in by_dtype.values():
        flat = _flatten_dense_tensors([b.detach() for b in bufs])
        broadcast(flat)
        for buf, value in zip(bufs, _unflatten_dense_tensors(flat, bufs), strict=True):
            # ``.data``: a training forward's graph holds the running statistics as inputs
            # (autograd would refuse the in-place write at backward), though a norm's backward
            # in training mode reads only the batch's statistics it saved.
            buf.data.copy_(value)


def agree_buffers_after_forward(root: nn.Module, buffers_of: nn.Module, broadcast: Broadcast
                                ) -> None:
    """After each training forward of ``root``, every rank takes rank 0's buffers of
    ``buffers_of`` (DDP's buffer semantics, see above); nothing for a model without
    running-statistics layers."""
    if not running_stat_norms(buffers_of):
        return

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if buffers_of.training:
            broadcast_buffers_(buffers_of, broadcast)

    root.register_forward_hook(hook)


def float32_norm_units(model: nn.Module) -> list[nn.Module]:
    """The norm layers with running statistics and weights, each to be its own float32 unit."""
    return [m for m in running_stat_norms(model)
            if m is not model and any(True for _ in m.parameters(recurse=False))]


def float32_norm_forward(model: nn.Module) -> None:
    """Makes each running-statistics norm layer of ``model`` compute with float32 copies of its
    (half-precision stored) weight and bias, as under DDP autocast: its buffers are float32,
    and torch's norm takes a half input with float32 weights but not half weights with float32
    statistics. The gradient reaches the stored weights through the copies."""
    for module in float32_norm_units(model):
        # A method bound to the layer, not a closure over it: ``copy.deepcopy`` (an EMA copy,
        # timm's ``ModelEmaV3``) rebinds it to the copy, where a closure would make the copy
        # compute with, and update the statistics of, the original. Inside the module's call
        # (not a pre-hook): ZeRO-3 gathers the parameters in hooks registered after this.
        module.forward = types.MethodType(_float32_forward, module)  # type: ignore[method-assign]


def _float32_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    with _Float32Parameters(module):
        return type(module).forward(module, *args, **kwargs)


class _Float32Parameters:
    __slots__ = ("module", "saved")

    def __init__(self, module: nn.Module) -> None:
        self.module, self.saved = module, dict(module._parameters)

    def __enter__(self) -> None:
        for name, param in self.saved.items():
            if param is not None and param.is_floating_point() and param.dtype != torch.float32:
                # A plain tensor in _parameters is what torch.nn.utils.stateless swaps in too.
                self.module._parameters[name] = param.float()  # type: ignore[assignment]

    def __exit__(self, *exc: Any) -> None:
        self.module._parameters.update(self.saved)
