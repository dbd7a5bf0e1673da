"""accumix.jax's window step against optax ``MultiSteps`` and Keras 3's gradient accumulation.

    python bench/jax_accum.py            # the default job (a few minutes here)
    python bench/jax_accum.py --tiny     # the smoke test's configuration (seconds)

One process, one CPU device, K = 8 micro-batches per optimizer step, AdamW, fp32, no clipping.
The job is a per-token MLP on ragged sequences: every row holds a random number of real tokens
(the rest masked), and every other micro-batch holds only short rows (as a length-bucketed
loader gives), so the micro-batches' token counts differ a lot. Each method is the same job
written the way its library's documentation recommends, from the same initial weights and the
same numpy data:

* accumix:    ``axj.Accelerator(strategy="single", precision="fp32", grad_accum_steps=K)``,
              ``loss_fn`` returning ``(loss_sum, num_items)``, ``step(state, acc.window(mbs))``:
              one jitted call per optimizer step (a ``lax.scan`` over the K micro-batches);
* MultiSteps: ``optax.MultiSteps(adamw, every_k_schedule=K)`` inside one jitted (donating)
              micro-step, called K times; its loss is each micro-batch's token mean;
* Keras:      a ``keras.Sequential`` of the same ``Dense`` layers (JAX backend),
              ``AdamW(gradient_accumulation_steps=K)``, ``MeanSquaredError(reduction=
              "mean_with_sample_weight")`` with the token mask as ``sample_weight``,
              ``model.fit(batch_size=rows, shuffle=False)``: each micro-batch's token mean;
* control:    accumix's compiled step again, on a state of its own: its ratio to accumix is
              the noise floor.

Distance: max abs parameter difference after ``--check-steps`` AdamW steps from the one-device
large-batch reference (each window's K micro-batches concatenated, one step on the mean over all
its tokens). The reference uses the method's own optimizer: optax's ``adamw`` for accumix and
MultiSteps, and Keras' ``AdamW`` (the same ``fit`` with ``batch_size=K*rows`` and no
accumulation) for Keras, whose Adam puts epsilon elsewhere (``eps * sqrt(1 - b2^t)``), which
alone moves weights whose gradients are tiny; that difference is printed as well. Adam divides
by the gradient's size, so a weight whose gradient is near zero moves by up to the learning
rate on rounding alone: the gradient's own distance is measured too, as the parameter
difference after one SGD step of learning rate 1 on the first window (the same formula in all
three libraries, against optax's). fp32's floor for both is printed: the large batch against
itself with each window's micro-batches concatenated in reverse order.

Time: the distance runs compile every method first. Rounds are interleaved, each method's
position rotating from round to round; a round is ``--steps`` optimizer steps of each method
(for Keras one ``fit`` call), ending when its parameters are ready. After ``--warmup`` untimed
rounds, each round's wall time and this process's CPU time per optimizer step
are recorded; the table shows medians and the median (and middle half) of the per-round ratios to
accumix's round (paired, so a drift of the machine's speed cancels).

Memory: ``temp_size_in_bytes`` of XLA's ``memory_analysis()`` for the compiled function each
method calls: accumix's window step (``step.lower(state, window)``), MultiSteps' jitted
micro-step, and Keras' own ``train_step`` jitted as its ``make_train_function`` does
(``jax.jit(model.train_step, donate_argnums=0)``); and the bytes of the state each keeps between
calls (parameters, optimizer state, accumulators, counters).
"""

from __future__ import annotations

import os

os.environ["KERAS_BACKEND"] = "jax"  # read when keras is first imported: before that

import argparse  # noqa: E402
import importlib.metadata  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from _common import fmt, machine_line, markdown_table, median, quartiles  # noqa: E402

K = 8  # micro-batches per optimizer step
MiB = 2**20

Batch = dict[str, np.ndarray]


@dataclass(kw_only=True)
class Trainer:
    """One library's way of training the job: ``run(windows)`` trains on them and returns when
    the parameters are ready; ``params()`` reads the weights in the reference's layout;
    ``memory()`` gives the XLA temp bytes of the compiled function it calls and the bytes of
    the state it keeps between calls; ``twin()``, where there is one, another trainer on the
    same compiled function."""

    run: Callable[[list[list[Batch]]], None]
    params: Callable[[], list[np.ndarray]]
    memory: Callable[[], tuple[float, float]]
    twin: Callable[[], Trainer] | None = None


@dataclass(kw_only=True)
class Method:
    """A row of the table: a trainer's measurements."""

    name: str
    run: Callable[[list[list[Batch]]], None] = lambda windows: None
    temp_bytes: float = float("nan")
    state_bytes: float = float("nan")
    distance: float = float("nan")  # AdamW, from its optimizer's large batch
    grad_distance: float = float("nan")  # SGD with lr 1, one window: the gradient's distance
    wall: list[float] = field(default_factory=list)  # seconds per optimizer step, per round
    cpu: list[float] = field(default_factory=list)
    error: str = ""


# -- the job ---------------------------------------------------------------------------------
def layer_sizes(args: argparse.Namespace) -> list[int]:
    return [args.features] + [args.width] * args.depth + [args.outputs]


def init_params(args: argparse.Namespace) -> list[dict[str, np.ndarray]]:
    """He-normal weights, zero biases: one ``{"w", "b"}`` per Dense layer."""
    rng = np.random.default_rng(0)
    sizes = layer_sizes(args)
    return [{"w": (rng.standard_normal((n_in, n_out)) * np.sqrt(2.0 / n_in)).astype(np.float32),
             "b": np.zeros((n_out,), np.float32)}
            for n_in, n_out in zip(sizes[:-1], sizes[1:], strict=True)]


def make_windows(args: argparse.Namespace, count: int, seed: int) -> list[list[Batch]]:
    """``count`` windows of K ragged micro-batches: x [rows, T, F], y [rows, T, O], mask [rows, T].

    Rows hold 1 to T real tokens; odd micro-batches only 1 to T/4 (a length-bucketed loader), so
    the per-micro-batch means that MultiSteps and Keras average weigh a short batch's tokens
    several times as much as a long one's."""
    rng = np.random.default_rng(seed)
    t = args.tokens
    windows = []
    for _ in range(count):
        window = []
        for i in range(K):
            longest = max(1, t // 4) if i % 2 else t
            lengths = rng.integers(1, longest + 1, size=(args.rows, 1))
            window.append({
                "x": rng.standard_normal((args.rows, t, args.features)).astype(np.float32),
                "y": rng.standard_normal((args.rows, t, args.outputs)).astype(np.float32),
                "mask": (np.arange(t)[None, :] < lengths).astype(np.float32),
            })
        windows.append(window)
    return windows


def forward(params: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def token_errors(params: Any, batch: Any) -> jax.Array:
    """Each token's squared error, averaged over the outputs (Keras' MeanSquaredError)."""
    return jnp.mean((forward(params, batch["x"]) - batch["y"]) ** 2, axis=-1)


def item_loss(params: Any, batch: Any, rng: Any = None) -> tuple[jax.Array, jax.Array]:
    """accumix's item mode: the masked sum and the token count."""
    return jnp.sum(token_errors(params, batch) * batch["mask"]), jnp.sum(batch["mask"])


def token_mean(params: Any, batch: Any) -> jax.Array:
    """One batch's mean over its real tokens: the large batch's loss, and MultiSteps' per
    micro-batch (which is what Keras' ``mean_with_sample_weight`` computes too)."""
    loss_sum, count = item_loss(params, batch)
    return loss_sum / count


def optax_optimizer(args: argparse.Namespace, kind: str) -> optax.GradientTransformation:
    if kind == "sgd":  # learning rate 1: the parameter difference is the gradient difference
        return optax.sgd(1.0)
    return optax.adamw(args.lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)


def concat(window: list[Batch]) -> Batch:
    return {key: np.concatenate([mb[key] for mb in window]) for key in window[0]}


def flat(params: Any) -> list[np.ndarray]:
    return [np.asarray(x) for layer in params for x in (layer["w"], layer["b"])]


def nbytes(tree: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def temp_bytes(lowered: Any) -> float:
    analysis = lowered.compile().memory_analysis()
    return float(analysis.temp_size_in_bytes) if analysis is not None else float("nan")


def max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    if not a or len(a) != len(b):
        return float("nan")
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


def ready(tree: Any) -> None:
    jax.block_until_ready(tree)


# -- the methods -----------------------------------------------------------------------------
def reference(args: argparse.Namespace, kind: str, *runs: list[list[Batch]]
              ) -> list[list[np.ndarray]]:
    """One device, one large batch per window, optax's optimizer: what accumulation must equal.
    Each run of windows starts from the initial weights; one compiled update serves them all."""
    tx = optax_optimizer(args, kind)

    @jax.jit
    def update(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any]:
        grads = jax.grad(token_mean)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    results = []
    for windows in runs:
        params = jax.tree.map(jnp.asarray, init_params(args))
        opt_state = tx.init(params)
        for window in windows:
            params, opt_state = update(params, opt_state, concat(window))
        results.append(flat(params))
    return results


def accumix_trainer(args: argparse.Namespace, kind: str) -> Trainer:
    import accumix.jax as axj

    acc = axj.Accelerator(strategy="single", precision="fp32", grad_accum_steps=K)
    tx = optax_optimizer(args, kind)
    state = acc.setup(init_params(args), tx)
    step = acc.train_step(item_loss)

    def trainer(state: Any) -> Trainer:
        holder = {"state": state}

        def run(windows: list[list[Batch]]) -> None:
            state = holder["state"]
            for window in windows:
                state, _ = step(state, acc.window(window))
            ready(state.params)
            holder["state"] = state

        def memory() -> tuple[float, float]:
            sample = acc.window(make_windows(args, 1, seed=99)[0])
            return temp_bytes(step.lower(holder["state"], sample)), nbytes(holder["state"])

        # The twin: the same compiled step on a state of its own, set up like the first.
        return Trainer(run=run, params=lambda: flat(holder["state"].params), memory=memory,
                       twin=lambda: trainer(acc.setup(init_params(args), tx)))

    return trainer(state)


def multisteps_trainer(args: argparse.Namespace, kind: str) -> Trainer:
    tx = optax.MultiSteps(optax_optimizer(args, kind), every_k_schedule=K)
    params = jax.tree.map(jnp.asarray, init_params(args))
    holder = {"params": params, "opt_state": tx.init(params)}

    # The usual optax loop (MultiSteps' documented use), jitted and donating like the others.
    def micro_step(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any]:
        grads = jax.grad(token_mean)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    jitted = jax.jit(micro_step, donate_argnums=(0, 1))

    def run(windows: list[list[Batch]]) -> None:
        params, opt_state = holder["params"], holder["opt_state"]
        for window in windows:
            for micro in window:
                params, opt_state = jitted(params, opt_state, micro)
        ready(params)
        holder["params"], holder["opt_state"] = params, opt_state

    def memory() -> tuple[float, float]:
        state = (holder["params"], holder["opt_state"])
        sample = make_windows(args, 1, seed=99)[0][0]
        return temp_bytes(jitted.lower(*state, sample)), nbytes(state)

    return Trainer(run=run, params=lambda: flat(holder["params"]), memory=memory)


def keras_trainer(args: argparse.Namespace, kind: str, accumulate: bool = True) -> Trainer:
    """Keras' fit; without ``accumulate``, its large batch (a whole window per batch)."""
    import keras

    sizes = layer_sizes(args)
    # Zeros: the weights are set from init_params below (and XLA compiles no random init).
    dense = [keras.layers.Dense(n, activation="relu" if i < len(sizes) - 2 else None,
                                kernel_initializer="zeros")
             for i, n in enumerate(sizes[1:])]
    model = keras.Sequential([keras.Input((args.tokens, args.features)), *dense])
    for layer, weights in zip(model.layers, init_params(args), strict=True):
        layer.set_weights([weights["w"], weights["b"]])
    steps = K if accumulate else None
    if kind == "sgd":
        optimizer = keras.optimizers.SGD(learning_rate=1.0, gradient_accumulation_steps=steps)
    else:
        optimizer = keras.optimizers.AdamW(
            learning_rate=args.lr, beta_1=0.9, beta_2=0.999, epsilon=1e-8, weight_decay=0.01,
            gradient_accumulation_steps=steps)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"))
    batch_size = args.rows if accumulate else K * args.rows

    def run(windows: list[list[Batch]]) -> None:
        data = concat([micro for window in windows for micro in window])
        model.fit(data["x"], data["y"], sample_weight=data["mask"], batch_size=batch_size,
                  epochs=1, shuffle=False, verbose=0)
        ready([v.value for v in model.trainable_variables])

    def memory() -> tuple[float, float]:
        # After a fit: the optimizer is built. This is what make_train_function jits (without
        # a distribution set it passes no out_shardings).
        state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                     optimizer_variables=True, metrics_variables=True)
        micro = make_windows(args, 1, seed=99)[0][0]
        jitted = jax.jit(model.train_step, donate_argnums=0)
        lowered = jitted.lower(state, (micro["x"], micro["y"], micro["mask"]))
        return temp_bytes(lowered), nbytes(state[:3])  # metrics variables: a few scalars

    def params() -> list[np.ndarray]:
        return [np.asarray(v) for layer in model.layers for v in layer.get_weights()]

    return Trainer(run=run, params=params, memory=memory)


# -- measuring -------------------------------------------------------------------------------
def measure(methods: list[Method], windows: list[list[Batch]], *, rounds: int,
            warmup: int) -> None:
    """Interleaved rounds (ABCD, BCDA, ...): each method runs in every position equally often."""
    live = [m for m in methods if not m.error]
    for round_index in range(warmup + rounds):
        start_at = round_index % len(live)
        for method in live[start_at:] + live[:start_at]:
            wall0, cpu0 = time.perf_counter(), time.process_time()
            method.run(windows)
            wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
            if round_index >= warmup:
                method.wall.append(wall / len(windows))
                method.cpu.append(cpu / len(windows))


LIBRARIES: list[tuple[str, Callable[[argparse.Namespace, str], Trainer]]] = [
    ("accumix.jax", accumix_trainer),
    ("optax MultiSteps", multisteps_trainer),
    ("Keras 3 gradient_accumulation_steps", keras_trainer),
]
CONTROL = "accumix.jax again (control)"


def build(args: argparse.Namespace, check: list[list[Batch]]
          ) -> tuple[list[Method], dict[str, float]]:
    """Every library's row: its AdamW trainer run on the check windows from the same weights
    (which also compiles it) and compared with its optimizer's large batch, then an SGD (lr 1)
    trainer on the first window for the gradient's distance; then the control, accumix's step
    on a second state. A library that fails gets a row saying why. Returns the rows and
    distances between large batches: optax's in reverse order (fp32's rounding, AdamW and SGD)
    and Keras' (its AdamW) from optax's."""
    # fp32's own floor: the same large batch, its micro-batches concatenated in reverse order.
    reversed_check = [window[::-1] for window in check]
    adamw, adamw_reversed = reference(args, "adamw", check, reversed_check)
    sgd_ref, sgd_reversed = reference(args, "sgd", check[:1], reversed_check[:1])
    floors = {"adamw": max_diff(adamw_reversed, adamw), "sgd": max_diff(sgd_reversed, sgd_ref),
              "keras": float("nan")}
    methods, twin = [], None
    for name, make in LIBRARIES:
        method = Method(name=name)
        try:
            own = adamw
            if make is keras_trainer:  # Keras' AdamW differs from optax's: its own large batch
                large = keras_trainer(args, "adamw", accumulate=False)
                large.run(check)
                own = large.params()
                floors["keras"] = max_diff(own, adamw)
            trainer = make(args, "adamw")
            trainer.run(check)
            method.run, method.distance = trainer.run, max_diff(trainer.params(), own)
            method.temp_bytes, method.state_bytes = trainer.memory()
            twin = twin or trainer.twin
            sgd = make(args, "sgd")
            sgd.run(check[:1])
            method.grad_distance = max_diff(sgd.params(), sgd_ref)
        except Exception as exc:  # ImportError, or a library failing on this machine
            method.error, method.run = f"{type(exc).__name__}: {exc}", lambda windows: None
        methods.append(method)
    control = Method(name=CONTROL, error="" if twin else "accumix.jax failed: see its row")
    if twin:
        trainer = twin()
        trainer.run(check)
        control.run, control.distance = trainer.run, max_diff(trainer.params(), adamw)
    return [*methods, control], floors


HEADERS = ["method", "ms / optimizer step (wall, median)", "x accumix (wall)",
           "x accumix, middle half", "CPU ms / step (median)", "x accumix (CPU)",
           "XLA temp MiB", "state MiB", "AdamW: max abs param diff vs large batch",
           "max abs grad diff vs large batch"]


def mib(value: float) -> str:
    return "-" if value != value else fmt(value / MiB, 4)  # NaN: not measured for this row


def sci(value: float) -> str:
    return "-" if value != value else f"{value:.1e}"


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def report(methods: list[Method], args: argparse.Namespace, floors: dict[str, float],
           check: list[list[Batch]], load: tuple[float, float]) -> str:
    mine = methods[0]
    rows = []
    for m in methods:
        if m.error:
            rows.append([m.name, f"n/a: {m.error}", *["n/a"] * (len(HEADERS) - 2)])
            continue
        # Paired with accumix's round: a drift of the machine's speed cancels.
        wall_ratios = [t / r for t, r in zip(m.wall, mine.wall, strict=False)]
        cpu_ratios = [t / r for t, r in zip(m.cpu, mine.cpu, strict=False)]
        low, high = quartiles(wall_ratios)
        rows.append([m.name, fmt(median(m.wall) * 1e3, 4), fmt(median(wall_ratios), 3),
                     f"{low:.2f} - {high:.2f}", fmt(median(m.cpu) * 1e3, 4),
                     fmt(median(cpu_ratios), 3), mib(m.temp_bytes), mib(m.state_bytes),
                     sci(m.distance), sci(m.grad_distance)])
    sizes = layer_sizes(args)
    num_params = sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:], strict=True))
    tokens = [int(micro["mask"].sum()) for window in check for micro in window]
    versions = "; ".join(f"{p} {version(p)}" for p in ("jax", "optax", "keras"))
    job = (f"job: per-token MLP {'-'.join(map(str, sizes))} ({num_params:,} params), ReLU, "
           f"micro-batch {args.rows} rows x {args.tokens} tokens, ragged ({min(tokens)} to "
           f"{max(tokens)} real tokens of {args.rows * args.tokens}), K={K}, AdamW lr "
           f"{args.lr}, fp32; param diff after {args.check_steps} optimizer steps, grad diff "
           f"after one SGD step of lr 1; {args.rounds} timed rounds of {args.steps} optimizer "
           f"steps after {args.warmup} warm-up; load average {load[0]:.2f} before, "
           f"{load[1]:.2f} after")
    notes = (f"fp32 rounding: the large batch vs itself with the micro-batches in reverse "
             f"order: AdamW param diff {floors['adamw']:.1e}, grad diff {floors['sgd']:.1e}; "
             f"Keras' own large batch (its AdamW) vs optax's: {floors['keras']:.1e} (where Adam "
             "puts epsilon)")
    return "\n".join([job, machine_line(versions), notes, "", markdown_table(HEADERS, rows)])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds per method")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--steps", type=int, default=1, help="optimizer steps per round")
    parser.add_argument("--check-steps", type=int, default=3,
                        help="optimizer steps before the distance is measured")
    parser.add_argument("--rows", type=int, default=4, help="rows per micro-batch")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per row (T)")
    parser.add_argument("--features", type=int, default=256, help="inputs per token")
    parser.add_argument("--width", type=int, default=2048, help="hidden width")
    parser.add_argument("--depth", type=int, default=4, help="hidden layers")
    parser.add_argument("--outputs", type=int, default=256, help="outputs per token")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate")
    parser.add_argument("--tiny", action="store_true",
                        help="a seconds-long smoke configuration (tests/unit)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.rounds, args.warmup, args.steps, args.check_steps = 2, 0, 1, 3
        args.rows, args.tokens, args.features, args.width = 2, 8, 8, 32
        args.depth, args.outputs, args.lr = 2, 4, 1e-2
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    check = make_windows(args, args.check_steps, seed=1)
    methods, floors = build(args, check)
    measure(methods, make_windows(args, args.steps, seed=2), rounds=args.rounds,
            warmup=args.warmup)
    print(report(methods, args, floors, check, (load_before, os.getloadavg()[0])),
          flush=True)


if __name__ == "__main__":
    main()
