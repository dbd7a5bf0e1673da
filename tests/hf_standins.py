"""Stand-ins for the Hugging Face types the micro-batch tests need (transformers is not installed
in this venv): the same Python types and behaviour accumix sees, nothing more.

* ``BatchEncoding``: a ``collections.UserDict`` (a Mapping, not a ``dict``) whose keys are also
  attributes and which moves with ``.to(device)``, as ``transformers.BatchEncoding``;
* ``ModelOutput``: an ``OrderedDict`` whose keys are also attributes (``out.loss``), as
  ``transformers.utils.ModelOutput``;
* ``TinyCausalLM``: ``forward(input_ids, attention_mask=None, labels=None)`` returns a
  ``ModelOutput`` whose ``loss`` is the mean cross-entropy over the shifted labels that are not
  -100 (a mean over *tokens*, as a causal LM's); its blocks carry the ``gradient_checkpointing``
  flag that ``gradient_checkpointing_enable()`` sets, as ``PreTrainedModel`` does, and run
  under ``torch.utils.checkpoint`` when it is on.
"""

from __future__ import annotations

from collections import OrderedDict, UserDict
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class BatchEncoding(UserDict):
    """A tokenizer's output: a Mapping of rows-first tensors."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self.data[name]
        except KeyError:
            raise AttributeError(name) from None

    def to(self, device: torch.device | str) -> BatchEncoding:
        self.data = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                     for k, v in self.data.items()}
        return self


class ModelOutput(OrderedDict):
    """A model's output: a dict whose keys read as attributes."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class Block(nn.Module):
    def __init__(self, width: int, expand: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, width * expand)
        self.down = nn.Linear(width * expand, width)
        self.gradient_checkpointing = False

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.gradient_checkpointing and self.training:
            return h + checkpoint(self._mlp, h, use_reentrant=False)
        return h + self._mlp(h)

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(h)).square())


class TinyCausalLM(nn.Module):
    def __init__(self, vocab: int = 32, width: int = 32, layers: int = 4, expand: int = 16,
                 seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, expand) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def gradient_checkpointing_enable(self) -> None:
        for module in self.modules():
            if hasattr(module, "gradient_checkpointing"):
                module.gradient_checkpointing = True

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> ModelOutput:
        h = self.embed(input_ids)
        if attention_mask is not None:
            h = h * attention_mask[..., None]
        for block in self.blocks:
            h = block(h)
        logits = self.head(h)
        out = ModelOutput(logits=logits)
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                ignore_index=-100)
        return out


def padded_batch(lengths: list[int], vocab: int = 32, seed: int = 0) -> BatchEncoding:
    """Right-padded token rows of the given lengths; labels -100 on the padding."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), width), generator=g)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = ids * mask
    labels = ids.masked_fill(mask == 0, -100)
    return BatchEncoding({"input_ids": ids, "attention_mask": mask, "labels": labels})
