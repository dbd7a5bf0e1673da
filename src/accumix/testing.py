"""Multi-process test helper: run a function on N ranks over gloo on loopback.

Each rank is a fresh ``spawn``-ed interpreter with torchrun's variables set, one CPU thread,
``MASTER_ADDR=127.0.0.1`` and a free port. Results come back in rank order; a rank's exception
is re-raised here with its traceback. Group many checks in one call: a spawn costs seconds.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailed(RuntimeError):
    """A spawned rank raised; the message holds its traceback."""


def _run_rank(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple[Any, ...],
              env: dict[str, str], queue: Any) -> None:
    os.environ.update(env)
    os.environ.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    })
    import torch

    torch.set_num_threads(1)
    try:
        queue.put((rank, True, fn(*args)))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable[..., Any], nprocs: int = 2, args: tuple[Any, ...] = (),
          env: dict[str, str] | None = None, timeout: float = 240.0) -> list[Any]:
    """Runs ``fn(*args)`` on ``nprocs`` ranks and returns each rank's result, rank order.

    Args:
        fn: a module-level (picklable) function.
        nprocs: the world size.
        args: passed to ``fn`` on every rank.
        env: extra environment variables for the ranks.
        timeout: seconds before the ranks are killed and this raises.

    Raises:
        RankFailed: a rank raised, died, or the run timed out.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    # Not daemonic: a rank may start DataLoader workers. The ``finally`` below kills any rank
    # still alive, so none outlives this call.
    procs = [
        ctx.Process(target=_run_rank, args=(fn, r, nprocs, port, args, env or {}, queue),
                    daemon=False)
        for r in range(nprocs)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(nprocs):
            try:
                rank, ok, value = queue.get(timeout=timeout)
            except Exception as exc:  # queue.Empty: a rank hung or died silently
                codes = [p.exitcode for p in procs]
                raise RankFailed(f"ranks did not finish in {timeout}s; exit codes {codes}"
                                 ) from exc
            if ok:
                results[rank] = value
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
    if errors:
        raise RankFailed("\n".join(errors))
    return [results[r] for r in range(nprocs)]


class ResidualBlock(nn.Module):
    """``x + tanh(Linear(x))``: a tiny repeated block that FSDP's auto wrap finds."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


# -- counting what collectives move ---------------------------------------------------------
# The torch.distributed functions that move tensors, and which of their tensors is the
# logical (unsharded) payload: an all-gather's output, a reduce-scatter's input, the tensor
# itself otherwise. FSDP2 (torch 2.13) calls all_gather_single / reduce_scatter_single /
# all_reduce; DeepSpeed's comm calls these through ``torch.distributed`` too.
_PAYLOAD = {  # name: (position, keyword) of the payload tensor (or list)
    "all_reduce": (0, "tensor"), "broadcast": (0, "tensor"), "reduce": (0, "tensor"),
    "all_gather_into_tensor": (0, "output_tensor"), "_all_gather_base": (0, "output_tensor"),
    "all_gather_single": (0, "output_tensor"), "all_gather": (0, "tensor_list"),
    "reduce_scatter_tensor": (1, "input"), "_reduce_scatter_base": (1, "input"),
    "reduce_scatter_single": (1, "input"), "reduce_scatter": (1, "input_list"),
    "all_to_all_single": (1, "input"),
}


class Collective(NamedTuple):
    """One collective call on this rank: the function, the group's global ranks, the payload's
    dtype and bytes (the whole logical tensor: what an all-gather delivers, what a
    reduce-scatter reduces)."""

    op: str
    ranks: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


class CollectiveLog:
    """Records every ``torch.distributed`` collective this process calls while active.

    ``with CollectiveLog() as log: ...`` patches the module's functions (code that looks them up
    as ``dist.<name>`` at call time is seen; C++ callers such as DDP's reducer without a comm
    hook are not). ``log.nbytes(where=...)`` sums the payloads, e.g. those whose group spans
    two nodes: ``where=lambda ranks: len({r // 2 for r in ranks}) > 1``.
    """

    def __init__(self, also: Sequence[tuple[Any, str, str]] = ()) -> None:
        """Args:
            also: ``(holder, attribute, collective)`` for functions a library bound before the
                log started (DeepSpeed's comm backend binds ``reduce_scatter_tensor`` when it
                initialises): ``holder.attribute`` is recorded as ``collective`` too.
        """
        self.calls: list[Collective] = []
        self.also = list(also)
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> CollectiveLog:
        import torch.distributed as dist

        targets = [(dist, name, name) for name in _PAYLOAD] + self.also
        for holder, attribute, name in targets:
            original = getattr(holder, attribute, None)
            if original is None:
                continue
            self._saved.append((holder, attribute, original))
            setattr(holder, attribute, self._wrap(name, _PAYLOAD[name], original))
        return self

    def __exit__(self, *exc: Any) -> None:
        for holder, attribute, original in reversed(self._saved):
            setattr(holder, attribute, original)
        self._saved.clear()

    def _wrap(self, name: str, where: tuple[int, str], original: Callable[..., Any]
              ) -> Callable[..., Any]:
        import torch.distributed as dist

        index, keyword = where

        def counted(*args: Any, **kwargs: Any) -> Any:
            tensor = args[index] if len(args) > index else kwargs.get(keyword)
            if isinstance(tensor, (list, tuple)):  # all_gather(list, t): the list's total
                tensors = [t for t in tensor if isinstance(t, torch.Tensor)]
            else:
                tensors = [tensor] if isinstance(tensor, torch.Tensor) else []
            group = kwargs.get("group")
            if group is None:
                group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            ranks = tuple(dist.get_process_group_ranks(group if group is not None
                                                       else dist.group.WORLD))
            if tensors:
                self.calls.append(Collective(name, ranks, tensors[0].dtype,
                                             sum(t.numel() * t.element_size() for t in tensors)))
            return original(*args, **kwargs)

        return counted

    def nbytes(self, where: Callable[[tuple[int, ...]], bool] | None = None,
               op: str | None = None) -> int:
        """The payload bytes of the calls whose group's ranks satisfy ``where`` (and ``op``)."""
        return sum(c.nbytes for c in self.calls
                   if (where is None or where(c.ranks)) and (op is None or c.op == op))


# -- what a reduce dtype costs in accuracy (issue 33) ---------------------------------------
class TinyTransformer(nn.Module):
    """A pre-norm causal transformer small enough for CPU tests (float64 works: the reference)."""

    def __init__(self, vocab: int = 64, width: int = 32, heads: int = 2, layers: int = 2,
                 seq: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(0.02 * torch.randn(seq, width))
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0, batch_first=True,
                                       norm_first=True) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=tokens.device).triu(1)
        x = self.embed(tokens) + self.pos[:seq]
        for block in self.blocks:
            x = block(x, src_mask=causal)
        return self.head(x)


def token_batches(steps: int, samples: int, *, vocab: int = 64, seq: int = 16, seed: int = 0
                  ) -> torch.Tensor:
    """``[steps, samples, seq + 1]`` random tokens: each optimizer step's global batch."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (steps, samples, seq + 1), generator=gen)


def next_token_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting each token from the ones before it."""
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                       tokens[:, 1:].reshape(-1))


def flat_weights(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """A state dict's tensors as one float64 vector, in order."""
    return torch.cat([v.detach().double().reshape(-1).cpu() for v in state.values()])


def reference_weights(batches: torch.Tensor, *, lr: float, momentum: float, seed: int = 0,
                      dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch on one process: one SGD step per global batch, in ``dtype``. Returns the
    initial and the final weights, flat."""
    torch.manual_seed(seed)
    model = TinyTransformer().to(dtype)
    first = flat_weights(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for batch in batches:
        opt.zero_grad()
        next_token_loss(model, batch).backward()
        opt.step()
    return first, flat_weights(model.state_dict())


def relative_errors(got: torch.Tensor, first: torch.Tensor, exact: torch.Tensor
                    ) -> dict[str, float]:
    """``weights``: ||w - w_exact|| / ||w_exact||; ``update``: the same over the training's
    own movement ||w_exact - w_0|| (the stricter one: the weights barely move in 10 steps)."""
    distance = (got - exact).norm().item()
    return {"weights": distance / exact.norm().item(),
            "update": distance / (exact - first).norm().item()}


def reduction_error_job(strategy: Any, *, reduce_dtype: str | None, precision: str,
                        grad_accum_steps: int, steps: int = 10, per_rank: int = 16,
                        lr: float = 0.1, momentum: float = 0.9, seed: int = 0) -> dict[str, Any]:
    """One rank of the issue-33 measurement: ``TinyTransformer`` trained with accumix (every
    rank ``per_rank`` samples per optimizer step in K micro-batches, so the global batch does
    not change with K), against the same run in float64 on one process (rank 0).

    Returns:
        ``bytes``: gradient payload bytes this rank handed to its collectives per optimizer
        step (``CollectiveLog`` around the backward calls: all-reduces and reduce-scatters);
        ``dtypes``: the collectives' dtypes; on rank 0 also ``weights`` and ``update``
        (``relative_errors``) and ``steps`` (optimizer steps taken).
    """
    import accumix as ax

    world = int(os.environ.get("WORLD_SIZE", "1"))
    batches = token_batches(steps, per_rank * world, seed=seed)
    acc = ax.Accelerator(strategy=strategy, precision=precision,
                         grad_accum_steps=grad_accum_steps, reduce_dtype=reduce_dtype)
    torch.manual_seed(seed)
    model = TinyTransformer()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    model, opt = acc.setup(model, opt)
    micro = per_rank // grad_accum_steps
    log = CollectiveLog()
    for batch in batches:
        mine = batch[acc.rank * per_rank:(acc.rank + 1) * per_rank]
        for part in mine.split(micro):
            with acc.accumulate():
                loss = next_token_loss(model, part)
                with log:
                    acc.backward(loss)
                opt.step()
                opt.zero_grad()
    grads = [c for c in log.calls if c.op == "all_reduce" or c.op.startswith("reduce_scatter")]
    out: dict[str, Any] = {"bytes": sum(c.nbytes for c in grads) / steps,
                           "dtypes": sorted({str(c.dtype) for c in grads}),
                           "effective": acc.effective_dtypes.describe()}
    state = acc.strategy.full_state_dict(model)
    if acc.rank == 0:
        first, exact = reference_weights(batches, lr=lr, momentum=momentum, seed=seed)
        out.update(relative_errors(flat_weights(state), first, exact), steps=acc.optimizer_steps)
    acc.end()
    return out
