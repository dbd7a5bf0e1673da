"""Multi-process test helper: run a function on N ranks over gloo on loopback.

Each rank is a fresh ``spawn``-ed interpreter with torchrun's variables set, one CPU thread,
``MASTER_ADDR=127.0.0.1`` and a free port. Results come back in rank order; a rank's exception
is re-raised here with its traceback. Group many checks in one call: a spawn costs seconds.
``spawn(fn, 4, nodes=2)`` simulates two machines of two ranks each: every rank gets the
per-node variables torchrun's agent on its node would set (``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``), on one loopback.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable
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


def node_variables(rank: int, world: int, nodes: int = 1) -> dict[str, str]:
    """torchrun's variables for ``rank`` of ``world`` ranks on ``nodes`` machines of equal size,
    ranks numbered node by node (as torchrun's agents number them).

    Args:
        rank: the global rank.
        world: the number of ranks over every node.
        nodes: the number of machines (it divides ``world``).

    Returns:
        ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` and
        ``GROUP_WORLD_SIZE``, as strings.
    """
    per_node = world // nodes
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % per_node),
            "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(rank // per_node),
            "GROUP_WORLD_SIZE": str(nodes)}


def _run_rank(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple[Any, ...],
              env: dict[str, str], queue: Any, nodes: int = 1) -> None:
    os.environ.update(env)
    os.environ.update({**node_variables(rank, world, nodes), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
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
          env: dict[str, str] | None = None, timeout: float = 240.0, *, nodes: int = 1
          ) -> list[Any]:
    """Runs ``fn(*args)`` on ``nprocs`` ranks and returns each rank's result, rank order.

    Args:
        fn: a module-level (picklable) function.
        nprocs: the world size.
        args: passed to ``fn`` on every rank.
        env: extra environment variables for the ranks.
        timeout: seconds before the ranks are killed and this raises.
        nodes: simulated machines, ``nprocs // nodes`` ranks each (consecutive ranks share
            one): the per-node variables are set as torchrun sets them on each node.

    Raises:
        RankFailed: a rank raised, died, or the run timed out.
        ValueError: ``nodes`` does not divide ``nprocs``.
    """
    if nodes < 1 or nprocs % nodes:
        raise ValueError(f"nodes={nodes} does not divide nprocs={nprocs}")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    # Not daemonic: a rank may start DataLoader workers. The ``finally`` below kills any rank
    # still alive, so none outlives this call.
    procs = [
        ctx.Process(target=_run_rank, args=(fn, r, nprocs, port, args, env or {}, queue, nodes),
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
    """``x + tanh(Linear(x))``: a tiny repeated block that FSDP's auto wrap finds.

    Args:
        width: the features in and out.
    """

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


# -- counting what collectives move ---------------------------------------------------------
# The functions that move tensors, and which of their tensors is the logical (unsharded)
# payload: an all-gather's output, a reduce-scatter's input, the tensor itself otherwise.
# FSDP2 (torch 2.13) calls torch.distributed's all_gather_single / reduce_scatter_single /
# all_reduce; DTensor (clip_grad_norm_'s norm, full_tensor) the functional collectives, whose
# all-gather returns its output (payload: the input times the group's size); DeepSpeed's comm
# backend binds torch.distributed's all-gather and reduce-scatter at its creation and calls
# them through its own methods.
_PAYLOAD = {  # name: (position, keyword) of the payload tensor (or list)
    "all_reduce": (0, "tensor"), "broadcast": (0, "tensor"), "reduce": (0, "tensor"),
    "all_gather_into_tensor": (0, "output_tensor"), "_all_gather_base": (0, "output_tensor"),
    "all_gather_single": (0, "output_tensor"), "all_gather": (0, "tensor_list"),
    "reduce_scatter_tensor": (1, "input"), "_reduce_scatter_base": (1, "input"),
    "reduce_scatter_single": (1, "input"), "reduce_scatter": (1, "input_list"),
    "all_to_all_single": (1, "input"),
}
# torch.distributed._functional_collectives: name -> position of ``group`` (payload: ``self``).
_FUNCOL_GROUP = {"all_reduce": 2, "broadcast": 2, "all_gather_single": 2,
                 "all_gather_tensor": 2, "reduce_scatter_single": 3,
                 "reduce_scatter_tensor": 3, "all_to_all_single": 3}
_GATHERS = ("all_gather_single", "all_gather_tensor")
# deepspeed.comm.torch.TorchBackend: name -> (position, keyword) of the payload (after self).
_DEEPSPEED = {"all_gather_into_tensor": (0, "output_tensor"),
              "all_gather_base": (0, "output_tensor"),
              "reduce_scatter_tensor": (1, "input_tensor")}


class Collective(NamedTuple):
    """One collective call on this rank, as ``CollectiveLog`` records it.

    Attributes:
        op: the function's name (``all_reduce``, ``reduce_scatter_tensor``, ...).
        ranks: the global ranks of the call's group.
        dtype: the payload's dtype.
        nbytes: the payload's bytes: the whole logical tensor (what an all-gather delivers,
            what a reduce-scatter reduces).
    """

    op: str
    ranks: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


class CollectiveLog:
    """Records every collective this process calls while active: ``torch.distributed``'s,
    the functional collectives DTensor uses, and DeepSpeed's comm backend's (when loaded).

    ``with CollectiveLog() as log: ...`` patches the modules' functions (code that looks them
    up as ``dist.<name>`` at call time is seen; C++ callers such as DDP's reducer without a comm
    hook are not). A call made inside another counted one (a wrapper calling the function it
    wraps) is counted once. ``log.nbytes(where=...)`` sums the payloads, e.g. those whose group
    spans two nodes: ``where=lambda ranks: len({r // 2 for r in ranks}) > 1``.
    """

    def __init__(self) -> None:
        self.calls: list[Collective] = []
        self._saved: list[tuple[Any, str, Any]] = []
        self._depth = 0

    def __enter__(self) -> CollectiveLog:
        import sys

        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        for name, where in _PAYLOAD.items():
            self._patch(dist, name, lambda args, kwargs, where=where: _payload(args, kwargs,
                                                                                 *where),
                        _group_of)
        for name, index in _FUNCOL_GROUP.items():
            factor = name in _GATHERS
            self._patch(funcol, name, lambda args, kwargs, factor=factor, index=index:
                        _funcol_payload(args, kwargs, index, factor),
                        lambda args, kwargs, index=index: _funcol_group(args, kwargs, index))
        backend = sys.modules.get("deepspeed.comm.torch")
        for name, where in _DEEPSPEED.items() if backend is not None else ():
            self._patch(backend.TorchBackend, name,
                        lambda args, kwargs, where=where: _payload(args[1:], kwargs, *where),
                        lambda args, kwargs: _group_of(args[1:], kwargs))
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    def _patch(self, owner: Any, name: str,
               payload: Callable[[tuple[Any, ...], dict[str, Any]], list[torch.Tensor]],
               group: Callable[[tuple[Any, ...], dict[str, Any]], tuple[int, ...]]) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return
        self._saved.append((owner, name, original))

        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:
                tensors = payload(args, kwargs)
                if tensors:
                    self.calls.append(Collective(name, group(args, kwargs), tensors[0].dtype,
                                                 sum(t.numel() * t.element_size()
                                                     for t in tensors)))
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        setattr(owner, name, counted)

    def nbytes(self, where: Callable[[tuple[int, ...]], bool] | None = None,
               op: str | None = None) -> int:
        """The payload bytes of the calls whose group's ranks satisfy ``where`` (and ``op``)."""
        return sum(c.nbytes for c in self.calls
                   if (where is None or where(c.ranks)) and (op is None or c.op == op))


def _payload(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, keyword: str
             ) -> list[torch.Tensor]:
    tensor = args[index] if len(args) > index else kwargs.get(keyword)
    if isinstance(tensor, (list, tuple)):  # all_gather(list, t): the list's total
        return [t for t in tensor if isinstance(t, torch.Tensor)]
    return [tensor] if isinstance(tensor, torch.Tensor) else []


def _group_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...]:
    import torch.distributed as dist

    group = kwargs.get("group")
    if group is None:
        group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _funcol_group(args: tuple[Any, ...], kwargs: dict[str, Any], index: int
                  ) -> tuple[int, ...]:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = funcol._resolve_group(args[index] if len(args) > index else kwargs["group"])
    if not isinstance(group, dist.ProcessGroup):
        group = _resolve_process_group(group)  # a group name (DeviceMesh dimensions)
    return tuple(dist.get_process_group_ranks(group))


def _funcol_payload(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, gathers: bool
                    ) -> list[torch.Tensor]:
    tensor = args[0] if args else kwargs.get("self")
    if not isinstance(tensor, torch.Tensor):
        return []
    if gathers:  # the output: every rank's input
        size = len(_funcol_group(args, kwargs, index))
        return [torch.empty(tensor.numel() * size, dtype=tensor.dtype, device="meta")]
    return [tensor]


# -- what a reduce dtype costs in accuracy (issue 33) ---------------------------------------
class TinyTransformer(nn.Module):
    """A pre-norm causal transformer small enough for CPU tests (float64 works: the reference).

    Args:
        vocab: token ids are below this.
        width: the residual stream's width.
        heads: attention heads per layer.
        layers: ``nn.TransformerEncoderLayer`` blocks.
        seq: the longest sequence (the learned position table's length).
    """

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
    """``[steps, samples, seq + 1]`` random tokens: each optimizer step's global batch.

    Args:
        steps: optimizer steps.
        samples: the global batch of each step.
        vocab: token ids are below this.
        seq: tokens per sample, plus one (the last token's target).
        seed: the generator's seed.
    """
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (steps, samples, seq + 1), generator=gen)


def next_token_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting each token from the ones before it.

    Args:
        model: maps ``[rows, seq]`` tokens to ``[rows, seq, vocab]`` logits.
        tokens: ``[rows, seq + 1]`` tokens.
    """
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                       tokens[:, 1:].reshape(-1))


def flat_weights(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """A state dict's tensors as one float64 vector, in order.

    Args:
        state: a model's ``state_dict()`` (full tensors).
    """
    return torch.cat([v.detach().double().reshape(-1).cpu() for v in state.values()])


def reference_weights(batches: torch.Tensor, *, lr: float, momentum: float, seed: int = 0,
                      dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch on one process: one SGD step per global batch, in ``dtype``.

    Args:
        batches: ``token_batches``' output, one global batch per step.
        lr: SGD's learning rate.
        momentum: SGD's momentum.
        seed: seeds the ``TinyTransformer``'s initialisation.
        dtype: the dtype the reference trains in (float64: the exact one).

    Returns:
        The initial and the final weights, flat (``flat_weights``).
    """
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
    """How far ``got`` is from ``exact``, relative to the weights and to the training's movement.

    Args:
        got: the weights to judge, flat.
        first: the initial weights, flat.
        exact: the reference's final weights, flat.

    Returns:
        ``weights``: ||w - w_exact|| / ||w_exact||; ``update``: the same over the training's
        own movement ||w_exact - w_0|| (the stricter one: the weights barely move in 10 steps).
    """
    distance = (got - exact).norm().item()
    return {"weights": distance / exact.norm().item(),
            "update": distance / (exact - first).norm().item()}


@functools.cache
def _float64_reference(steps: int, batch: int, lr: float, momentum: float, seed: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference_weights`` of ``token_batches(steps, batch, seed=seed)``: the same for every
    strategy, dtype and K of ``reduction_error_job``, so computed once per process."""
    return reference_weights(token_batches(steps, batch, seed=seed), lr=lr, momentum=momentum,
                             seed=seed)


def reduction_error_job(strategy: Any, *, reduce_dtype: str | None, precision: str,
                        grad_accum_steps: int, steps: int = 10, per_rank: int = 16,
                        lr: float = 0.1, momentum: float = 0.9, seed: int = 0) -> dict[str, Any]:
    """One rank of the issue-33 measurement: ``TinyTransformer`` trained with accumix (every
    rank ``per_rank`` samples per optimizer step in K micro-batches, so the global batch does
    not change with K), against the same run in float64 on one process (rank 0).

    Args:
        strategy: a strategy word or object.
        reduce_dtype: the ``Accelerator``'s ``reduce_dtype``.
        precision: the precision word.
        grad_accum_steps: K.
        steps: optimizer steps.
        per_rank: each rank's samples per optimizer step (split into K micro-batches).
        lr: SGD's learning rate.
        momentum: SGD's momentum.
        seed: the data's and the model's seed.

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
        first, exact = _float64_reference(steps, per_rank * world, lr, momentum, seed)
        out.update(relative_errors(flat_weights(state), first, exact), steps=acc.optimizer_steps)
    acc.end()
    return out
