"""The out-of-memory safety net on one process: a micro-batch whose forward raises
``torch.OutOfMemoryError`` runs as pieces of the same micro-step, in the plain loop
(``acc.run_micro_batch``) and in the Trainer, with the unsplit run's parameters, losses and
optimizer steps; batches of every shape are cut along their rows."""

from __future__ import annotations

import logging
from collections import namedtuple
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import accumix as ax
from accumix.errors import ConfigError
from accumix.memory.oom_split import slice_batch, split_loss
from accumix.trainer import Trainer
from tests import workloads as w
from tests.oom_injection import LogLines, make_model

K, MICRO = 3, 4
INJECT = {1: 1, 5: 2}  # batch index -> rows the forward may take (off the boundary, on it)


def _loop(*, items: bool, inject: bool) -> tuple[list[torch.Tensor], int, list[Any], int]:
    model = make_model(in_features=4 if items else 6)
    head = model[-1]
    acc = ax.Accelerator(strategy="single", precision="fp32", grad_accum_steps=K)
    opt = torch.optim.SGD(model.parameters(), lr=w.LR, momentum=w.MOMENTUM)
    data = w.sequence_data(2 * K * MICRO) if items else w.regression_data(2 * K * MICRO)
    model, opt, loader = acc.setup(model, opt, DataLoader(data, batch_size=MICRO))
    outs = []
    for index, batch in enumerate(loader):
        head.limit = INJECT.get(index) if inject else None
        with acc.accumulate():
            out = acc.run_micro_batch(
                (lambda part: w.item_loss(model, part)) if items
                else (lambda part: w.mean_loss(model, part)), batch)
            opt.step()
            opt.zero_grad()
        outs.extend([float(out[0].detach()), float(out[1])] if items else [float(out.detach())])
    return [p.detach().clone() for p in model.parameters()], acc.optimizer_steps, outs, head.raised


@pytest.mark.parametrize("items", [False, True])
def test_plain_loop_splits_with_the_unsplit_gradient(items: bool) -> None:
    plain = _loop(items=items, inject=False)
    handler = LogLines()  # accumix's logger does not propagate to caplog's root handler
    logging.getLogger("accumix").addHandler(handler)
    try:
        split = _loop(items=items, inject=True)
    finally:
        logging.getLogger("accumix").removeHandler(handler)
    assert split[3] == 4  # 4 rows, then both halves off the boundary; 4 rows on it
    assert plain[1] == split[1] == 2
    diff = max((a - b).abs().max().item() for a, b in zip(plain[0], split[0], strict=True))
    print(f"items={items}: max |split - unsplit| = {diff:.2e}")
    assert diff < 1e-6
    assert split[2] == pytest.approx(plain[2], rel=1e-6)
    lines = [line for line in handler.lines if "out of memory" in line]
    assert len(lines) == 2 and "4 pieces" in lines[0] and "2 pieces" in lines[1], lines


def test_without_the_net_the_injected_error_stops_the_loop() -> None:
    """What the safety net replaces: the plain forward + backward raises."""
    model = make_model()
    model[-1].limit = 1
    acc = ax.Accelerator(strategy="single", precision="fp32")
    opt = torch.optim.SGD(model.parameters(), lr=w.LR)
    model, opt = acc.setup(model, opt)
    x, y = w.regression_data(4).tensors
    with pytest.raises(torch.OutOfMemoryError), acc.accumulate():
        acc.backward(w.mean_loss(model, (x, y)))


def test_one_row_that_does_not_fit_raises() -> None:
    model = make_model()
    model[-1].limit = 0
    acc = ax.Accelerator(strategy="single", precision="fp32")
    model, _ = acc.setup(model, torch.optim.SGD(model.parameters(), lr=w.LR))
    with pytest.raises(torch.OutOfMemoryError, match="piece of one row"), acc.accumulate():
        acc.run_micro_batch(lambda part: w.mean_loss(model, part),
                            w.regression_data(4).tensors)


def _trainer_params(inject: bool) -> tuple[list[torch.Tensor], int]:
    model = make_model()
    model[-1].limit = 2 if inject else None
    acc = ax.Accelerator(precision="fp32", grad_accum_steps=K)
    trainer = Trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=w.LR),
                      train_loader=DataLoader(w.regression_data(2 * K * MICRO),
                                              batch_size=MICRO),
                      accelerator=acc, step_fn=w.mean_loss, max_epochs=1, progress_bar=False,
                      loggers=[], grad_clip=None)
    trainer.fit()
    return [p.detach().clone() for p in model.parameters()], acc.optimizer_steps


def test_trainer_splits_with_nothing_more_to_write() -> None:
    plain, steps = _trainer_params(inject=False)
    split, split_steps = _trainer_params(inject=True)
    assert steps == split_steps == 2
    assert max((a - b).abs().max().item() for a, b in zip(plain, split, strict=True)) < 1e-6


def test_slice_batch_cuts_every_part_with_the_rows() -> None:
    Pair = namedtuple("Pair", "x mask")
    batch = {"ids": torch.arange(8).reshape(4, 2), "pair": Pair(torch.arange(4), torch.ones(4)),
             "texts": ["a", "b", "c", "d"], "table": torch.zeros(3, 5), "n": 7}
    part = slice_batch(batch, 1, 3, 4)
    assert part["ids"].tolist() == [[2, 3], [4, 5]]
    assert isinstance(part["pair"], Pair) and part["pair"].x.tolist() == [1, 2]
    assert part["texts"] == ["b", "c"]
    assert part["table"].shape == (3, 5) and part["n"] == 7  # not rows: kept whole


def test_a_loss_and_logits_pair_is_not_read_as_a_count() -> None:
    loss, logits = torch.tensor(2.0), torch.randn(3, 5)
    with pytest.raises(ConfigError, match=r"shape \(3, 5\).*output\[0\]"):
        split_loss((loss, logits))
    assert split_loss((loss, torch.tensor(4))) == (loss, torch.tensor(4))
    assert split_loss((loss, 4)) == (loss, 4)
    assert split_loss(loss) == (loss, None)
