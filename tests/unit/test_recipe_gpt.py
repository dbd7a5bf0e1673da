from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from accumix.recipes.gpt import GPT, Block, GPTConfig


def tiny_config(**overrides: object) -> GPTConfig:
    fields = dict(block_size=16, n_layer=2, n_head=2, n_embd=32)
    fields.update(overrides)
    return GPTConfig(**fields)  # type: ignore[arg-type]


@pytest.fixture
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(tiny_config()).eval()


def test_loss_sum_and_num_items_match_hand_computation(model: GPT) -> None:
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 256, (3, 10), generator=gen)
    labels = torch.randint(0, 256, (3, 10), generator=gen)
    # Rows of different true lengths: 10, 4 and 7 labelled positions.
    labels[1, 4:] = -100
    labels[2, 7:] = -100

    loss_sum, num_items = model(idx, labels)

    logits = model(idx)
    per_token = F.cross_entropy(
        logits.float().reshape(-1, 256), labels.reshape(-1).clamp(min=0), reduction="none"
    )
    mask = labels.reshape(-1) != -100
    expected = (per_token * mask).sum()
    torch.testing.assert_close(loss_sum, expected)
    assert loss_sum.dtype == torch.float32 and loss_sum.dim() == 0
    assert isinstance(num_items, torch.Tensor) and num_items.dim() == 0
    assert int(num_items) == 10 + 4 + 7


def test_padded_positions_do_not_change_the_loss(model: GPT) -> None:
    idx = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(2))
    labels = idx.roll(-1, dims=1)
    labels[0, -1] = -100
    short_sum, short_n = model(idx, labels)

    padded_idx = torch.cat([idx, torch.zeros(1, 5, dtype=torch.long)], dim=1)
    padded_labels = torch.cat([labels, torch.full((1, 5), -100)], dim=1)
    long_sum, long_n = model(padded_idx, padded_labels)

    # Causal attention: trailing padding cannot reach the earlier positions.
    torch.testing.assert_close(short_sum, long_sum)
    assert int(short_n) == int(long_n) == 5


def test_attention_is_causal(model: GPT) -> None:
    idx = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    changed = idx.clone()
    changed[:, 8] = (changed[:, 8] + 1) % 256
    before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :8], after[:, :8])
    assert not torch.allclose(before[:, 8:], after[:, 8:])


def test_weights_are_tied_and_counted_once() -> None:
    model = GPT(tiny_config())
    assert model.lm_head.weight is model.wte.weight
    assert model.lm_head.weight.data_ptr() == model.wte.weight.data_ptr()
    untied = GPT(tiny_config(tie_weights=False))
    assert untied.lm_head.weight.data_ptr() != untied.wte.weight.data_ptr()
    extra = untied.num_parameters(non_embedding=False) - model.num_parameters(non_embedding=False)
    assert extra == 256 * 32


def test_blocks_are_a_module_list_of_block() -> None:
    model = GPT(tiny_config(n_layer=3))
    assert isinstance(model.blocks, torch.nn.ModuleList)
    assert [type(block) for block in model.blocks] == [Block] * 3


def test_residual_projections_use_scaled_init() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=8))
    assert model.blocks[0].mlp.c_proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert model.blocks[0].mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_generate_shape_and_determinism(model: GPT) -> None:
    prompt = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(4))
    # 20 new tokens pushes the context past block_size=16, exercising the crop.
    first = model.generate(prompt, 20, top_k=10, generator=torch.Generator().manual_seed(7))
    second = model.generate(prompt, 20, top_k=10, generator=torch.Generator().manual_seed(7))
    assert first.shape == (2, 25)
    assert torch.equal(first[:, :5], prompt)
    assert torch.equal(first, second)
    assert int(first.min()) >= 0 and int(first.max()) < 256


def test_greedy_generation_picks_the_argmax(model: GPT) -> None:
    prompt = torch.tensor([[1, 2, 3]])
    out = model.generate(prompt, 1, temperature=0.0)
    assert int(out[0, -1]) == int(model(prompt)[0, -1].argmax())


def test_default_parameter_count_and_flops() -> None:
    model = GPT(GPTConfig())
    count = model.num_parameters()
    assert count == 3_225_088
    assert 1e6 < count < 2e7
    assert model.num_parameters(non_embedding=False) == count + 256 * 256
    assert model.flops_per_token() == 6 * count + 12 * 4 * 256 * 256


def test_gpt2_small_shape() -> None:
    config = GPTConfig.gpt2_small()
    assert (config.n_layer, config.n_head, config.n_embd, config.block_size) == (12, 12, 768, 1024)
    assert config.vocab_size == 256


def test_rejects_bad_config_and_long_input(model: GPT) -> None:
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 17, dtype=torch.long))
