"""``micro_batch_size="auto"`` with what users bring (issue 28, cases 3, 4, 6, 7, 8, 14, 15):
samples that are numpy arrays or token lists, a dataset with its own generator, a parameter the
optimizer steps outside the model, a model setting that changes memory but no shape, an
IterableDataset, estimate-memory for several ranks and non-finite limits (case 11, two FSDP
models, needs two ranks: ``tests/distributed/test_micro_batch_auto.py``). Each run is
compared with the explicit run of the chosen size, bitwise, or with the right number."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

import accumix as ax
from accumix.memory.micro_batch_cache import CACHE_FILE
from accumix.memory.probe_batch import batch_maker
from tests.frozen_heap import frozen_heap
from tests.hf_standins import BatchEncoding, TinyCausalLM, padded_batch

GLOBAL = 24


@pytest.fixture(autouse=True)
def _frozen_heap() -> Iterator[None]:
    with frozen_heap():  # the probes' garbage passes see this test's objects only
        yield


def _pad(samples: list[Any]) -> torch.Tensor:
    rows = [torch.as_tensor(s["input_ids"] if isinstance(s, dict) else s) for s in samples]
    return nn.utils.rnn.pad_sequence(rows, batch_first=True)


def test_probe_batch_is_the_largest_sample_of_numpy_arrays_and_token_lists() -> None:
    """Samples of 8, 256 and 16 tokens: the probe batch has 256 (before: the first sample's 8
    unless the samples were torch tensors)."""
    kinds = {"numpy": lambda n: np.arange(n), "list": lambda n: list(range(n)),
             "dict of list": lambda n: {"input_ids": list(range(n))}}
    for kind, make in kinds.items():
        loader = DataLoader([make(8), make(256), make(16)], batch_size=2, collate_fn=_pad)
        assert tuple(batch_maker(loader)(3).shape) == (3, 256), kind


class Noisy(Dataset):
    """Numpy samples with noise from the dataset's own generator (not the global streams)."""

    def __init__(self) -> None:
        self.x = np.random.default_rng(1).standard_normal((48, 64)).astype(np.float32)
        self.rng = np.random.default_rng(0)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.x[i] + 0.1 * self.rng.standard_normal(64).astype(np.float32)


def test_trainer_scan_keeps_the_datasets_own_generator() -> None:
    """The Trainer reads samples to find the largest: the dataset's generator is put back, so
    the auto run augments as the explicit run does, bitwise (before: 3.1e-3 apart)."""
    from accumix.trainer import Trainer

    weights = []
    for micro in ("auto", GLOBAL):
        acc = ax.Accelerator(global_batch_size=GLOBAL, micro_batch_size=micro, seed=0,
                             memory_limit=2**30)
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 1))
        trainer = Trainer(model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=0.1),
                          train_loader=DataLoader(Noisy(), batch_size=5 if micro == "auto"
                                                  else micro, shuffle=True),
                          accelerator=acc, step_fn=lambda m, x: m(x).square().mean(),
                          max_steps=2, progress_bar=False, loggers=[])
        trainer.fit()
        assert trainer.train_loader.batch_size == GLOBAL
        weights.append([p.detach().clone() for p in net.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights, strict=True))


def _encoded(samples: list[torch.Tensor]) -> BatchEncoding:
    ids = torch.stack(samples)
    return BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                          "labels": ids})


def test_trainer_default_step_takes_a_tokenizers_batch_encoding() -> None:
    """A collate returning a ``BatchEncoding`` (a ``UserDict``, as Hugging Face's collators do)
    and no ``step_fn``: the default step calls ``model(**batch)``, with auto as explicitly, and
    both train the same weights (before: ``model(batch)``, a raw ``TypeError: embedding()
    ... not BatchEncoding`` in the probe and in the explicit run)."""
    from accumix.trainer import Trainer

    g = torch.Generator().manual_seed(0)
    data = [torch.randint(1, 32, (8,), generator=g) for _ in range(16)]
    weights = []
    for micro in ("auto", 8):
        acc = ax.Accelerator(global_batch_size=8, micro_batch_size=micro, seed=0,
                             memory_limit=2**30)
        net = TinyCausalLM(layers=1)
        trainer = Trainer(model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=0.01),
                          train_loader=DataLoader(data, batch_size=4 if micro == "auto" else 8,
                                                  collate_fn=_encoded),
                          accelerator=acc, max_steps=2, progress_bar=False, loggers=[])
        trainer.fit()
        weights.append([p.detach().clone() for p in net.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights, strict=True))
    assert not torch.equal(weights[0][-1], TinyCausalLM(layers=1).head.bias)  # it trained


def _temperature_run(micro: int | str) -> list[torch.Tensor]:
    acc = ax.Accelerator(global_batch_size=GLOBAL, micro_batch_size=micro, seed=0)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    temperature = torch.tensor(1.0, requires_grad=True)  # a plain leaf tensor, no Parameter
    model, opt = acc.setup(net, torch.optim.SGD([*net.parameters(), temperature], lr=0.1))

    def step(batch: Any) -> torch.Tensor:
        return (model(batch[0]) / temperature - batch[1]).square().mean()

    if micro == "auto":
        acc.find_micro_batch_size(step, lambda n: (torch.randn(n, 6), torch.randn(n, 1)))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(48, 6, generator=g), torch.randn(48, 1, generator=g))
    for batch in acc.setup(DataLoader(data, batch_size=2 if micro == "auto" else micro)):
        with acc.accumulate():
            acc.backward(step(batch))
            opt.step()
            opt.zero_grad()
    return [temperature.detach().clone(), *(p.detach().clone() for p in net.parameters())]


def test_a_parameter_outside_the_model_keeps_no_probe_gradient() -> None:
    """A learnable loss temperature the optimizer steps: the probes' gradients do not reach
    its first step (before: 0.934723 with auto, 0.948973 explicit)."""
    auto, explicit = _temperature_run("auto"), _temperature_run(GLOBAL)
    assert all(torch.equal(a, b) for a, b in zip(auto, explicit, strict=True))
    assert auto[0].item() != 1.0


class RunningNorm(nn.Module):
    """A running input normaliser (RL's RunningMeanStd): its forward *replaces* the buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 1)
        self.register_buffer("mean", torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.mean = 0.9 * self.mean + 0.1 * x.mean(0).detach()
        return self.lin(x - self.mean)


def _running_norm_run(micro: int | str) -> list[torch.Tensor]:
    acc = ax.Accelerator(global_batch_size=8, micro_batch_size=micro, seed=0,
                         memory_limit=2**30)
    torch.manual_seed(0)
    net = RunningNorm()
    model, opt = acc.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))

    def step(batch: Any) -> torch.Tensor:
        return (model(batch[0]) - batch[1]).square().mean()

    if micro == "auto":
        acc.find_micro_batch_size(step, lambda n: (torch.full((n, 6), 100.0), torch.zeros(n, 1)))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(16, 6, generator=g), torch.randn(16, 1, generator=g))
    for batch in acc.setup(DataLoader(data, batch_size=acc.micro_batch_size)):
        with acc.accumulate():
            acc.backward(step(batch))
            opt.step()
            opt.zero_grad()
    return [net.mean.clone(), *(p.detach().clone() for p in net.parameters())]


def test_a_buffer_the_forward_replaces_is_put_back_after_the_probe() -> None:
    """The probes' forwards replace the running mean with new tensors: the model gets its own
    back, and trains as the explicit run does, bitwise (before: the buffer kept the probes'
    37.9 where the explicit run has -0.039, the weights 2.9e5 apart)."""
    auto, explicit = _running_norm_run("auto"), _running_norm_run(8)
    assert all(torch.equal(a, b) for a, b in zip(auto, explicit, strict=True))


def _lbfgs_run(micro: int | str) -> list[torch.Tensor]:
    acc = ax.Accelerator(global_batch_size=8, micro_batch_size=micro, seed=0,
                         memory_limit=2**30)
    torch.manual_seed(0)
    net = nn.Linear(6, 1)
    model, opt = acc.setup(net, torch.optim.LBFGS(net.parameters(), lr=0.1))

    def step(batch: Any) -> torch.Tensor:
        return (model(batch[0]) - batch[1]).square().mean()

    if micro == "auto":
        acc.find_micro_batch_size(step, lambda n: (torch.randn(n, 6), torch.zeros(n, 1)))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(16, 6, generator=g), torch.randn(16, 1, generator=g))
    for batch in acc.setup(DataLoader(data, batch_size=acc.micro_batch_size)):
        def closure(batch: Any = batch) -> torch.Tensor:
            opt.zero_grad()
            loss = step(batch)
            acc.backward(loss)
            return loss

        with acc.accumulate():
            opt.step(closure)
    return [p.detach().clone() for p in net.parameters()]


def test_an_optimizer_whose_step_needs_a_closure_is_probed() -> None:
    """LBFGS: the probe cannot step a copy of it without the user's closure, so its states are
    left out (a warning) and the run equals the explicit one, bitwise (before: auto raised
    torch's raw ``TypeError: LBFGS.step() missing ... 'closure'``; the explicit run trains)."""
    auto, explicit = _lbfgs_run("auto"), _lbfgs_run(8)
    assert all(torch.equal(a, b) for a, b in zip(auto, explicit, strict=True))
    torch.manual_seed(0)
    assert not torch.equal(auto[1], nn.Linear(6, 1).bias)  # it trained


class SparseBag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 4, sparse=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.emb(x).sum(-1)


def _sparse_adam_run(micro: int | str) -> list[torch.Tensor]:
    acc = ax.Accelerator(global_batch_size=8, micro_batch_size=micro, seed=0,
                         memory_limit=2**30)
    torch.manual_seed(0)
    net = SparseBag()
    model, opt = acc.setup(net, torch.optim.SparseAdam(list(net.parameters()), lr=0.1))

    def step(batch: Any) -> torch.Tensor:
        return (model(batch[0]) - batch[1]).square().mean()

    if micro == "auto":
        acc.find_micro_batch_size(step, lambda n: (torch.randint(0, 50, (n,)), torch.zeros(n)))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randint(0, 50, (16,), generator=g), torch.randn(16, generator=g))
    for batch in acc.setup(DataLoader(data, batch_size=acc.micro_batch_size)):
        with acc.accumulate():
            acc.backward(step(batch))
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in net.parameters()]


def test_an_optimizer_refusing_dense_zero_gradients_is_probed() -> None:
    """SparseAdam over a sparse embedding: the probe's copy refuses the dense zero gradients it
    is stepped with, so its states are left out (a warning) and the run equals the explicit one
    (before: auto raised SparseAdam's raw ``RuntimeError: ... dense gradients``)."""
    auto, explicit = _sparse_adam_run("auto"), _sparse_adam_run(8)
    assert all(torch.equal(a, b) for a, b in zip(auto, explicit, strict=True))
    torch.manual_seed(0)
    assert not torch.equal(auto[0], SparseBag().emb.weight)  # it trained


def test_cache_keys_a_setting_that_changes_memory_but_no_shape(tmp_path: Path) -> None:
    """A (stand-in) Hugging Face model: with gradient checkpointing 16 rows fit 4.8 MB (4.0 MB
    used); the restart without it probes again and chooses 8 (before: it reused 16 with no
    probe, and 16 rows need 5.0 MB without checkpointing)."""
    chosen = []
    for checkpointing in (True, False):
        acc = ax.Accelerator(global_batch_size=16, micro_batch_size="auto",
                             memory_limit=4_800_000, precision="fp32")
        net = TinyCausalLM(layers=2)
        if checkpointing:
            net.gradient_checkpointing_enable()
        model, _ = acc.setup(net, torch.optim.AdamW(net.parameters()))
        acc.find_micro_batch_size(lambda b, m=model: m(**b), lambda n: padded_batch([16] * n),
                                  run_dir=tmp_path)
        chosen.append((acc.micro_batch_choice.micro_batch_size, acc.micro_batch_choice.probes > 0))
    assert chosen == [(16, True), (8, True)]
    assert len(json.loads((tmp_path / CACHE_FILE).read_text())) == 2


class Stream(IterableDataset):
    def __iter__(self) -> Any:
        g = torch.Generator().manual_seed(1)
        for _ in range(48):
            yield torch.randn(6, generator=g), torch.randn(1, generator=g)


def _stream_run(micro: int | str) -> list[torch.Tensor]:
    acc = ax.Accelerator(global_batch_size=GLOBAL, micro_batch_size=micro, seed=0,
                         memory_limit=2**30)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    model, opt = acc.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))

    def step(batch: Any) -> torch.Tensor:
        return (model(batch[0]) - batch[1]).square().mean()

    if micro == "auto":
        acc.find_micro_batch_size(step, lambda n: (torch.randn(n, 6), torch.randn(n, 1)))
    loader = acc.setup(DataLoader(Stream(), batch_size=2 if micro == "auto" else micro))
    assert loader.batch_size == GLOBAL
    for batch in loader:
        with acc.accumulate():
            acc.backward(step(batch))
            opt.step()
            opt.zero_grad()
    assert acc.optimizer_steps == 2
    return [p.detach().clone() for p in net.parameters()]


def test_an_iterable_dataset_loader_is_re_batched() -> None:
    """After auto, an IterableDataset's loader is re-batched to the choice and trains as the
    explicit run, bitwise (before: torch's raw ValueError about a sampler option)."""
    auto, explicit = _stream_run("auto"), _stream_run(GLOBAL)
    assert all(torch.equal(a, b) for a, b in zip(auto, explicit, strict=True))


def test_estimate_memory_auto_on_two_ranks_is_per_rank(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Global 16 on 2 ranks: at most 8 rows a rank (before: 'micro batch 16', the probe ran as
    one process of one rank)."""
    from accumix.cli.main import main

    assert main(["estimate-memory", "model.n_layer=1", "model.n_embd=64", "model.n_head=2",
                 "model.block_size=64", "global_batch_size=16", "micro_batch_size=auto",
                 "memory_limit=200000000", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "micro_batch_size=auto chose 8 (K=1 on 2 ranks, global 16): peak" in out
    assert "micro batch 8 x 64 tokens" in out
    assert main(["estimate-memory", "model.n_layer=1", "model.n_embd=64", "model.n_head=2",
                 "model.block_size=64", "global_batch_size=15", "micro_batch_size=auto",
                 "--world-size", "2"]) == 2  # 15 does not divide over 2 ranks


def test_non_finite_memory_limit_is_one_line_on_both_backends() -> None:
    accelerators = [ax.Accelerator]
    try:
        import accumix.jax as axj

        accelerators.append(axj.Accelerator)
    except ImportError:  # the torch side still runs
        pass
    for accelerator in accelerators:
        for value in (math.inf, math.nan, np.float64("inf")):
            with pytest.raises(ax.ConfigError, match=r"memory_limit=\S*(inf|nan)\)? is inv") as e:
                accelerator(global_batch_size=8, micro_batch_size="auto", memory_limit=value)
            assert "\n" not in str(e.value)
