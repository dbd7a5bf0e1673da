"""Memory model: exact byte counts per strategy, the "auto" choice, block detection, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from accumix.memory import device_memory
from accumix.memory.device_memory import device_free_bytes
from accumix.memory.model import (
    PRECISIONS,
    STRATEGIES,
    SYNC_ROWS,
    MemoryEstimate,
    count_params,
    estimate_memory,
    format_table,
    gathered_params,
    repeated_blocks,
)
from accumix.memory.strategy_choice import StrategyChoice, choose_strategy

GIB = 1024**3
M = 1_000_000


def _parts(estimates: list[MemoryEstimate]) -> dict[str, tuple[int, int, int]]:
    return {e.strategy: (e.params_bytes, e.grads_bytes, e.optimizer_bytes) for e in estimates}


def test_fp32_adam_world_2() -> None:
    estimates = estimate_memory(M, world_size=2, optimizer_states=2, block_params=100_000)
    assert [e.strategy for e in estimates] == list(STRATEGIES)
    assert _parts(estimates) == {
        "ddp": (4 * M, 4 * M, 8 * M),
        "zero1": (4 * M, 4 * M, 4 * M),  # states halved
        # shards halved, plus the fp32 unsharded copy kept from forward to backward
        "fsdp-grad_op": (2 * M + 4 * M, 2 * M, 4 * M),
        "fsdp-full": (2 * M + 4 * 100_000, 2 * M, 4 * M),  # plus one gathered block
        "deepspeed-1": (4 * M, 4 * M, 6 * M),  # ZeRO 1/2 clone an fp32 partition
        "deepspeed-2": (4 * M, 2 * M, 6 * M),
        "deepspeed-3": (2 * M + 4 * 100_000, 2 * M, 4 * M),
    }
    for estimate in estimates:
        parts = estimate.params_bytes + estimate.grads_bytes + estimate.optimizer_bytes
        assert estimate.total_bytes == parts
        assert estimate.activation_bytes == 0
        assert estimate.fits is None  # no device size given


def test_bf16_mixed_torch_keeps_fp32_deepspeed_keeps_16_bytes() -> None:
    estimates = estimate_memory(M, world_size=2, precision="bf16-mixed", block_params=100_000)
    assert _parts(estimates) == {
        "ddp": (4 * M, 4 * M, 8 * M),  # autocast: fp32 params, grads, states; no master copy
        "zero1": (4 * M, 4 * M, 4 * M),
        "fsdp-grad_op": (2 * M + 2 * M, 2 * M, 4 * M),  # fp32 shards + bf16 gathered model
        "fsdp-full": (2 * M + 2 * 100_000, 2 * M, 4 * M),
        "deepspeed-1": (2 * M, 2 * M, 6 * M),  # (4 master + 2 * 4 states) / 2
        "deepspeed-2": (2 * M, 1 * M, 6 * M),
        "deepspeed-3": (1 * M + 2 * 100_000, 1 * M, 6 * M),
    }
    fp16 = estimate_memory(M, world_size=2, precision="fp16-mixed", block_params=100_000)
    assert fp16 == estimates


def test_bf16_true_and_optimizer_state_counts() -> None:
    estimates = estimate_memory(M, world_size=4, precision="bf16-true", block_params=0)
    parts = _parts(estimates)
    assert parts["ddp"] == (2 * M, 2 * M, 4 * M)
    assert parts["zero1"] == (2 * M, 2 * M, 1 * M)
    assert parts["fsdp-full"] == (M // 2, M // 2, 1 * M)
    assert parts["deepspeed-3"] == (M // 2, M // 2, 3 * M)  # fp32 master + states kept
    sgd_momentum = _parts(estimate_memory(M, world_size=4, optimizer_states=1))
    assert sgd_momentum["ddp"] == (4 * M, 4 * M, 4 * M)
    assert sgd_momentum["zero1"][2] == M
    plain_sgd = _parts(estimate_memory(M, world_size=4, precision="bf16-mixed", optimizer_states=0))
    assert plain_sgd["ddp"][2] == 0
    assert plain_sgd["deepspeed-1"][2] == M  # the fp32 master copy remains, sharded


def test_a_window_holds_fsdps_gradients_unsharded() -> None:
    """From K=2 FSDP2's default sums the window in unsharded, full-size gradients (measured:
    tests/distributed/test_memory_model.py); the model counted their shards."""
    one = _parts(estimate_memory(M, world_size=2, block_params=100_000))
    window = estimate_memory(M, world_size=2, block_params=100_000, grad_accum_steps=2)
    assert [e.strategy for e in window] == [*STRATEGIES[:4], *SYNC_ROWS, *STRATEGIES[4:]]
    parts = _parts(window)
    assert parts["fsdp-grad_op"] == (2 * M + 4 * M, 4 * M, 4 * M)  # fp32 grads, not halved
    assert parts["fsdp-full"] == (2 * M + 4 * 100_000, 4 * M, 4 * M)
    # sync_each_microstep reduce-scatters every micro-step: the shards, as at K=1
    assert parts["fsdp-grad_op-sync"] == one["fsdp-grad_op"]
    assert parts["fsdp-full-sync"] == one["fsdp-full"]
    assert all(parts[name] == one[name] for name in STRATEGIES if not name.startswith("fsdp"))
    # K not known yet (micro_batch_size="auto"): sized as a window, the larger figure
    assert _parts(estimate_memory(M, world_size=2, block_params=100_000,
                                  grad_accum_steps=None)) == parts
    # the window sums in the stored dtype: bf16 under bf16-true, fp32 under the mixed ones
    true = _parts(estimate_memory(M, world_size=2, precision="bf16-true", block_params=0,
                                  grad_accum_steps=8))
    assert (true["fsdp-full"][1], true["fsdp-full-sync"][1]) == (2 * M, M)
    mixed = _parts(estimate_memory(M, world_size=2, precision="bf16-mixed", block_params=0,
                                   grad_accum_steps=8))
    assert (mixed["fsdp-full"][1], mixed["fsdp-full-sync"][1]) == (4 * M, 2 * M)
    with pytest.raises(ValueError, match="grad_accum_steps must be an int >= 1, got 0"):
        estimate_memory(M, world_size=2, grad_accum_steps=0)


def test_zero_paper_figure_1() -> None:
    # Rajbhandari et al. 2020, figure 1: 7.5B params, 64 GPUs, K=12 (mixed-precision Adam).
    estimates = estimate_memory(
        7_500_000_000, world_size=64, precision="bf16-mixed", block_params=0
    )
    totals = {e.strategy: e.total_bytes for e in estimates}
    assert totals["deepspeed-1"] == 30_000_000_000 + 1_406_250_000  # 31.4 GB
    assert totals["deepspeed-2"] == 15_000_000_000 + 1_640_625_000  # 16.6 GB
    assert totals["deepspeed-3"] == 1_875_000_000  # 1.9 GB


def test_activations_rounding_and_fits() -> None:
    estimates = estimate_memory(
        3, world_size=2, activation_bytes=1000, device_bytes=1040, headroom=1.0, block_params=1
    )
    by_name = {e.strategy: e for e in estimates}
    assert all(e.activation_bytes == 1000 for e in estimates)
    assert by_name["ddp"].total_bytes == 12 + 12 + 24 + 1000
    # 3 params over 2 ranks: each rank holds 2 elements, as FSDP2 pads the shards.
    assert by_name["fsdp-full"].params_bytes == 4 * 2 + 4 * 1
    assert by_name["fsdp-full"].grads_bytes == 4 * 2
    assert by_name["fsdp-full"].optimizer_bytes == 8 * 2
    assert by_name["ddp"].fits is False
    assert by_name["fsdp-full"].fits is True


def test_world_size_1_shards_nothing() -> None:
    estimates = estimate_memory(M, world_size=1, block_params=0)
    ddp = estimates[0]
    kept_copies = {"fsdp-grad_op": 4 * M, "deepspeed-1": 4 * M, "deepspeed-2": 4 * M}
    assert all(e.total_bytes == ddp.total_bytes + kept_copies.get(e.strategy, 0)
               for e in estimates)


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class _TinyGPT(nn.Module):
    def __init__(self, vocab: int = 10, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(4, width)
        self.blocks = nn.ModuleList(_Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied: counted once


def test_sequential_of_identical_blocks() -> None:
    def block() -> nn.Sequential:
        return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))

    stack = nn.Sequential(*(block() for _ in range(4)))
    model = nn.Sequential(nn.Linear(4, 8), stack, nn.Linear(8, 2))
    # The two root Linears repeat too, but the stack of 4 blocks repeats most; the Linears
    # inside a block are not blocks.
    assert repeated_blocks(model) == list(stack)
    per_block = 2 * (8 * 8 + 8)
    outside = (4 * 8 + 8) + (8 * 2 + 2)
    assert count_params(model) == 4 * per_block + outside
    assert gathered_params(model) == per_block + outside

    estimates = estimate_memory(model, world_size=2, precision="bf16-mixed")
    n = count_params(model)
    full = {e.strategy: e for e in estimates}["fsdp-full"]
    assert full.params_bytes == 4 * n // 2 + 2 * (per_block + outside)
    assert full.grads_bytes == 4 * n // 2


def test_gpt_like_model_tied_and_frozen() -> None:
    with torch.device("meta"):  # sizing must not need real memory
        model = _TinyGPT()
    width, vocab = 8, 10
    per_block = 2 * width + (width * 4 * width + 4 * width) + (4 * width * width + width)
    outside = vocab * width + 4 * width + 2 * width  # wte (tied with head), wpe, final norm
    assert repeated_blocks(model) == list(model.blocks)
    assert count_params(model) == 3 * per_block + outside
    assert gathered_params(model) == per_block + outside

    model.wpe.requires_grad_(False)
    n = count_params(model)
    trainable = count_params(model, trainable_only=True)
    assert trainable == n - 4 * width
    ddp = estimate_memory(model, world_size=2)[0]
    assert (ddp.params_bytes, ddp.grads_bytes, ddp.optimizer_bytes) == (
        4 * n,
        4 * trainable,
        8 * trainable,
    )


def test_model_without_repeats_is_one_unit() -> None:
    model = nn.Linear(4, 4)
    assert repeated_blocks(model) == []
    assert gathered_params(model) == 20
    by_name = {e.strategy: e for e in estimate_memory(model, world_size=2, block_params=5)}
    assert by_name["fsdp-full"].params_bytes == 40 + 20  # an explicit block_params wins


def _ladder(device_gib: float, *, world_size: int = 2) -> StrategyChoice:
    # 2**30 params, bf16-mixed Adam, W=2: ddp 16, zero1 12, grad_op 10, full 8.5 GiB per rank.
    estimates = estimate_memory(2**30, world_size=2, precision="bf16-mixed", block_params=2**28)
    totals = [e.total_bytes / GIB for e in estimates[:4]]
    assert totals == [16.0, 12.0, 10.0, 8.5]
    return choose_strategy(
        estimates, device_bytes=int(device_gib * GIB), headroom=0.8, world_size=world_size
    )


def test_choose_strategy_ladder() -> None:
    assert _ladder(24) == StrategyChoice(
        strategy="ddp", sharding=None, reason="ddp: 16.00 GiB per rank fits 80% of 24.00 GiB"
    )
    assert _ladder(16) == StrategyChoice(
        strategy="zero1",
        sharding=None,
        reason="zero1: 12.00 GiB per rank fits 80% of 16.00 GiB; ddp needs 16.00 GiB",
    )
    assert _ladder(13) == StrategyChoice(
        strategy="fsdp",
        sharding="grad_op",
        reason="fsdp (sharding=grad_op): 10.00 GiB per rank fits 80% of 13.00 GiB; "
        "ddp needs 16.00 GiB",
    )
    full = _ladder(11)
    assert (full.strategy, full.sharding) == ("fsdp", "full")
    assert full.reason.startswith("fsdp (sharding=full): 8.50 GiB per rank fits 80% of 11.00 GiB")


def test_choose_strategy_nothing_fits_and_single() -> None:
    too_small = _ladder(10)
    assert (too_small.strategy, too_small.sharding) == ("fsdp", "full")
    assert too_small.reason.startswith(
        "fsdp (sharding=full): 8.50 GiB per rank does not fit 80% of 10.00 GiB (8.00 GiB), "
        "0.50 GiB over; nothing fits"
    )
    single = _ladder(24, world_size=1)
    assert single == StrategyChoice(
        strategy="single",
        sharding=None,
        reason="single (world size 1): 16.00 GiB per rank fits 80% of 24.00 GiB",
    )
    assert "does not fit" in _ladder(10, world_size=1).reason


def test_choose_strategy_with_a_window_counts_its_gradients() -> None:
    # 2**30 params, bf16-mixed Adam, W=2, K=2: ddp 16, zero1 12, grad_op 12, full 10.5 GiB (the
    # window's fp32 gradients unsharded: 4 GiB, not 2), grad_op sync 10, full sync 8.5
    estimates = estimate_memory(2**30, world_size=2, precision="bf16-mixed", block_params=2**28,
                                grad_accum_steps=2)
    assert [e.total_bytes / GIB for e in estimates[:6]] == [16.0, 12.0, 12.0, 10.5, 10.0, 8.5]

    def pick(gib: float) -> StrategyChoice:
        return choose_strategy(estimates, device_bytes=int(gib * GIB), world_size=2)

    full = pick(13.5)
    assert (full.strategy, full.sharding, full.sync_each_microstep) == ("fsdp", "full", False)
    grad_op = pick(12.8)
    assert (grad_op.strategy, grad_op.sharding, grad_op.sync_each_microstep) == (
        "fsdp", "grad_op", True)
    # 11 GiB: the K=1 model said fsdp full (8.5 GiB), whose window holds 10.5 GiB
    assert pick(11) == StrategyChoice(
        strategy="fsdp", sharding="full", sync_each_microstep=True,
        reason="fsdp (sharding=full, sync_each_microstep=True): 8.50 GiB per rank fits 80% of "
        "11.00 GiB; ddp needs 16.00 GiB; its default would hold the window's unsharded "
        "gradients (10.50 GiB)")
    too_small = pick(10)
    assert (too_small.sharding, too_small.sync_each_microstep) == ("full", True)
    assert too_small.reason.startswith(
        "fsdp (sharding=full, sync_each_microstep=True): 8.50 GiB per rank does not fit")
    assert "nothing fits" in too_small.reason


def test_to_row_and_format_table() -> None:
    estimates = estimate_memory(
        2**30, world_size=2, precision="bf16-mixed", block_params=2**28, device_bytes=13 * GIB
    )
    assert estimates[0].to_row() == ("ddp", "4.00", "4.00", "8.00", "0.00", "16.00", "no")
    assert estimates[2].to_row()[-1] == "yes"
    lines = format_table(estimates).splitlines()
    assert len(lines) == 1 + len(STRATEGIES)
    assert lines[0].split()[:3] == ["strategy", "params", "GiB"]
    assert len({len(line) for line in lines}) == 1  # aligned columns
    assert lines[4].split() == ["fsdp-full", "2.50", "2.00", "4.00", "0.00", "8.50", "yes"]


def test_device_free_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    free = device_free_bytes(torch.device("cpu"))
    assert isinstance(free, int) and free > 0
    monkeypatch.setattr(device_memory, "_host_available_bytes", lambda: 1000)
    assert device_free_bytes("cpu", local_world_size=4) == 250
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (123, 456))
    assert device_free_bytes(torch.device("cuda", 0)) == 123
    with pytest.raises(ValueError, match="local_world_size"):
        device_free_bytes("cpu", local_world_size=0)
    with pytest.raises(ValueError, match="'meta'.*cuda or cpu"):
        device_free_bytes("meta")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 0}, "world_size must be an int >= 1, got 0"),
        ({"world_size": 2, "precision": "bf16"}, "unknown precision 'bf16'; choose one of fp32"),
        ({"world_size": 2, "optimizer_states": -1}, "optimizer_states must be an int >= 0"),
        ({"world_size": 2, "activation_bytes": -5}, "activation_bytes must be an int >= 0"),
        ({"world_size": 2, "headroom": 0.0}, r"headroom must be in \(0, 1\]"),
        ({"world_size": 2, "headroom": 1.5}, r"headroom must be in \(0, 1\]"),
        ({"world_size": 2, "device_bytes": 0}, "device_bytes must be > 0"),
        ({"world_size": 2, "block_params": 11}, "block_params=11 exceeds the 10 parameters"),
    ],
)
def test_estimate_memory_rejects_bad_input(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        estimate_memory(10, **kwargs)


def test_bad_counts_and_choice_inputs() -> None:
    with pytest.raises(ValueError, match="num_params must be an int >= 0, got -1"):
        estimate_memory(-1, world_size=2)
    with pytest.raises(ValueError, match="num_params"):
        estimate_memory(1.5, world_size=2)  # type: ignore[arg-type]
    estimates = estimate_memory(10, world_size=2)
    with pytest.raises(ValueError, match="world_size"):
        choose_strategy(estimates, device_bytes=GIB, world_size=0)
    with pytest.raises(ValueError, match="device_bytes"):
        choose_strategy(estimates, device_bytes=-1, world_size=2)
    with pytest.raises(ValueError, match="estimates lack zero1, fsdp-full"):
        choose_strategy(estimates[::2], device_bytes=GIB, world_size=2)
    assert set(PRECISIONS) == {"fp32", "bf16-mixed", "fp16-mixed", "bf16-true"}


def test_names_moved_out_of_the_memory_model_stay_importable_from_it() -> None:
    """choose_strategy, StrategyChoice and device_free_bytes moved to their own modules; code
    that imported them from accumix.memory.model gets the same objects."""
    from accumix.memory import device_memory, model, strategy_choice

    assert model.choose_strategy is strategy_choice.choose_strategy
    assert model.StrategyChoice is strategy_choice.StrategyChoice
    assert model.device_free_bytes is device_memory.device_free_bytes
