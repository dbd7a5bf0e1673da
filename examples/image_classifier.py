"""An image classifier: Lightning Fabric's ``image_classifier/train_fabric.py`` written for
accumix, on synthetic 12x12 digits-like images (no download, seconds on a CPU).

    python examples/image_classifier.py
    torchrun --nproc-per-node 2 examples/image_classifier.py --epochs 2

What differs from the Fabric script, and why (docs/guides/migrating.md): ``acc.setup`` takes the
loaders with the model and optimizer; the test set goes through ``acc.setup_eval_loader``, which
gives each sample to one rank (Fabric's ``setup_dataloaders`` pads it with repeats, so its test
loss, a padded sum over ``len(dataset)``, is off on several processes), and the sums are
``acc.reduce``-d: the test loss and accuracy are the one-process values on any world size. The
StepLR is stepped once per epoch by hand, as in the Fabric script, so it is not set up (a set-up
scheduler follows the optimizer's steps).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import accumix as ax

SIDE, CLASSES = 12, 10


def make_images(count: int, seed: int) -> TensorDataset:
    """Noisy copies of one random 12x12 template per class, normalised as MNIST's are."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.rand(CLASSES, 1, SIDE, SIDE, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, CLASSES, (count,), generator=g)
    images = 0.6 * templates[labels] + torch.rand(count, 1, SIDE, SIDE, generator=g)
    return TensorDataset((images - 0.1307) / 0.3081, labels)


class Net(nn.Module):
    """Fabric's MNIST network, narrower: two convolutions, max-pool, dropout, two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(16 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def run(hparams: argparse.Namespace) -> dict[str, Any]:
    """Trains and tests each epoch; returns what the tests compare."""
    acc = ax.Accelerator(precision=hparams.precision, seed=hparams.seed)
    train_loader = DataLoader(make_images(hparams.train_size, seed=1),
                              batch_size=hparams.batch_size)
    test_loader = DataLoader(make_images(hparams.test_size, seed=2),
                             batch_size=hparams.batch_size)
    model = Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=hparams.lr)
    model, optimizer, train_loader = acc.setup(model, optimizer, train_loader)
    test_loader = acc.setup_eval_loader(test_loader)  # each sample once over the ranks
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=hparams.gamma)

    history = []
    for epoch in range(1, hparams.epochs + 1):
        model.train()
        for batch_idx, (data, target) in enumerate(train_loader):
            with acc.accumulate():
                loss = F.nll_loss(model(data), target)
                acc.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if batch_idx == 0 or (batch_idx + 1) % hparams.log_interval == 0:
                acc.print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/"
                          f"{len(train_loader.dataset)}]\tLoss: {loss.item():.6f}")
        scheduler.step()

        model.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=acc.device)  # loss, correct, count
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data)
                # float64 sums: the order of the additions (per rank, then over ranks) does
                # not show in the result
                sums += torch.stack([F.nll_loss(output.double(), target, reduction="sum"),
                                     (output.argmax(1) == target).sum().double(),
                                     torch.tensor(float(len(target)), dtype=torch.float64,
                                                  device=acc.device)])
        loss_sum, correct, count = acc.reduce(sums, "sum").tolist()
        history.append({"epoch": epoch, "test_loss": loss_sum / count,
                        "accuracy": correct / count, "tested": int(count)})
        acc.print(f"\nTest set: Average loss: {loss_sum / count:.4f}, Accuracy: "
                  f"{int(correct)}/{int(count)} ({100 * correct / count:.0f}%)\n")
    acc.end()
    params = {k: v.detach().clone() for k, v in acc.unwrap(model).state_dict().items()}
    return {"params": params, "history": history}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7, help="learning-rate step gamma")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--train-size", type=int, default=2000)
    parser.add_argument("--test-size", type=int, default=500)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run(parse_args(argv))


if __name__ == "__main__":
    main()
