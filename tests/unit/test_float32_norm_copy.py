"""DeepSpeed's bf16 norm layers compute with float32 copies of their weights
(``float32_norm_forward``); a deep copy of such a model (an EMA copy) must compute with its own
weights and update its own statistics, not the original's."""

from __future__ import annotations

import copy

import torch
from torch import nn

from accumix.strategies.norm_layers import float32_norm_forward


def test_deepcopy_of_float32_norm_model_uses_its_own_weights_and_buffers() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(4)).bfloat16()
    for buf in model[0].buffers():  # DeepSpeed's bf16 module keeps float32 statistics here
        buf.data = buf.data.float() if buf.is_floating_point() else buf.data
    float32_norm_forward(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin[0].weight.fill_(3.0)
    x = torch.randn(8, 4).bfloat16()
    # Plain PyTorch reference: a float32 BatchNorm with weight 3 on the same bf16 input.
    reference = nn.BatchNorm1d(4)
    with torch.no_grad():
        reference.weight.fill_(3.0)
    out, ref = twin.train()(x), reference.train()(x)
    # Before: the copy ran the original's weight (1.0): max difference 3.75.
    assert torch.equal(out, ref), (out - ref).abs().max().item()
    assert torch.equal(twin[0].running_mean, reference.running_mean)
    assert int(twin[0].num_batches_tracked) == 1
    # The original is untouched by the copy's training forward.
    assert torch.equal(model[0].running_mean, torch.zeros(4))
    assert int(model[0].num_batches_tracked) == 0
    assert model[0].weight.dtype == torch.bfloat16 and twin[0].weight.dtype == torch.bfloat16
    out.float().sum().backward()
    assert twin[0].weight.grad is not None and twin[0].weight.grad.dtype == torch.bfloat16
    assert model[0].weight.grad is None
