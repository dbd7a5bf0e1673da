"""Where a compiled accumix.jax window step's bytes are at its peak, from XLA's own dumps.

    python bench/jax_fsdp_peak.py                   # the 8-layer flax GPT (issue 30)
    python bench/jax_fsdp_peak.py --layers 2 --strategies fsdp

``memory_analysis()`` gives two totals (arguments, temporaries); this says what they hold. XLA
writes, per compiled module, its schedule, every buffer's live range and the buffer assignment
(``--xla_dump_to``, set here before JAX loads, with 4 host devices). For each strategy's window
step (``tests/scripts/jax_fsdp_memory.py``'s job: Adam, K=4, 2 rows per device, fp32) this
script takes the instruction XLA names as the peak and sorts every buffer live there:

* arguments: the step's inputs (param shards, optimizer state, the window);
* carried: values the micro-step loop carries (the float32 gradient accumulators);
* activations: values the forward made and the backward still needs (op names ``jvp(...)``);
* gathered: all-gathered weights alive for the backward; other backward buffers: the rest of
  ``transpose(...)`` (cotangents, a weight's gradient before it joins its accumulator);
* packing: arguments + temporaries minus the live bytes (the gaps XLA's heap packing leaves).

"plain" is ``jax.jit(jax.grad(loss_fn))`` on one device for one device's rows: its
activations when its backward starts (the instruction where the forward's live values peak),
and how many of those bytes XLA keeps in the buffers of the gradients it returns (they are
empty until the backward writes them, so ``temp_size`` alone undercounts plain's activations).
The floor of a strategy is what its peak cannot do without: arguments + carried +
activations + gathered (each strategy's activations at its peak are compared with plain's);
the rest is other backward buffers, other, and packing. Numbers are MiB per device. Reads
XLA's text dumps: a jax whose dump format changed stops with a message, not a wrong table.
"""

from __future__ import annotations

import os
import tempfile

DUMP = tempfile.mkdtemp(prefix="accumix-xla-dump-")
os.environ["XLA_FLAGS"] = (  # after the caller's own flags
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4 "
    "--xla_dump_hlo_as_text "
    f"--xla_dump_to={DUMP} --xla_dump_hlo_module_re=^jit_(step|plain_grad)$")

import argparse  # noqa: E402
import collections  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from tests.scripts import jax_fsdp_memory as job  # noqa: E402

import accumix.jax as axj  # noqa: E402
from _common import machine_line, markdown_table  # noqa: E402

MIB = 2**20
PARTS = ("arguments", "carried", "activations", "gathered", "other backward", "other")


class Dump:
    """One compiled module's schedule, live ranges, buffer sizes and op names."""

    def __init__(self, live_range: Path) -> None:
        stem = str(live_range)[: -len("-live-range.txt")]
        lines = live_range.read_text().splitlines()
        hlo = Path(stem + ".txt").read_text()
        assignment = Path(stem + "-buffer-assignment.txt").read_text()
        self.op = {m[1]: m[2] for m in re.finditer(
            r'^\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name="([^"]*)"', hlo, re.M)}
        self.size: dict[str, int] = {}
        self.kind: dict[str, str] = {}
        for block in re.split(r"\nallocation ", assignment):
            head = block.split("\n", 1)[0]
            kind = ("temp" if "preallocated-temp" in head else
                    "argument" if "parameter" in head else
                    "output" if "maybe-live-out" in head or "output" in head else "other")
            for name, index, size in re.findall(
                    r"value: <\d+ ([\w.\-]+)(\{[\d,]*\})?(?: \(phi\))? @0> \(size=(\d+)", block):
                self.size[name + (index or "{}")] = int(size)
                self.kind[name + (index or "{}")] = kind
        self.temp = max((int(s) for s in re.findall(
            r"allocation \d+: size (\d+), preallocated-temp", assignment)), default=0)
        self.arguments = sum(int(s) for s in re.findall(
            r"allocation \d+: size (\d+), parameter", assignment))
        self.ranges: dict[str, tuple[int, int]] = {}
        for line in lines:
            m = re.match(r"\s+(\S+\{[\d,]*\}):(\d+)-(\d+)$", line)
            if m:
                self.ranges[m[1]] = (int(m[2]), int(m[3]))
        # XLA's own list of the buffers live at its peak, with their bytes.
        start = next((i for i, line in enumerate(lines) if "(peak):" in line), None)
        self.at_peak: dict[str, int] = {}
        for line in lines[start + 1:] if start is not None else []:
            m = re.match(r"\s+(\S+\{[\d,]*\}): (\d+) bytes", line)
            if not m:
                break
            self.at_peak[m[1]] = int(m[2])
        if not self.ranges or not self.size or not self.at_peak:
            raise SystemExit(f"{live_range}: not the XLA dump format this script reads")

    def part(self, buffer: str) -> str:
        """Which of ``PARTS`` a buffer belongs to."""
        name = buffer.split("{")[0]
        op = self.op.get(name, "")
        if self.kind.get(buffer) == "argument":
            return "arguments"
        if name.startswith("param."):  # a loop body's parameter: what the loop carries
            return "carried"
        if "transpose(" in op:
            return "gathered" if "all_gather" in op else "other backward"
        return "activations" if "jvp(" in op else "other"

    def peak_parts(self) -> dict[str, int]:
        """The bytes live at XLA's peak, by part."""
        out: collections.Counter[str] = collections.Counter()
        for buffer, size in self.at_peak.items():
            out[self.part(buffer)] += size
        return dict(out)

    def activation_peak(self) -> tuple[int, int, int]:
        """``(time, bytes, bytes in output buffers)`` where the forward's live values peak."""
        events: collections.Counter[int] = collections.Counter()
        for buffer, (start, end) in self.ranges.items():
            if buffer in self.size and self.part(buffer) == "activations":
                events[start] += self.size[buffer]
                events[end + 1] -= self.size[buffer]
        best, when, running = 0, 0, 0
        for t in sorted(events):
            running += events[t]
            if running > best:
                best, when = running, t
        parked = sum(self.size[b] for b, (s, e) in self.ranges.items()
                     if s <= when <= e and b in self.size and self.kind[b] == "output"
                     and self.part(b) == "activations")
        return when, best, parked


def compiled_dump(compile_fn) -> Dump:
    """Compile (``compile_fn()``) and read the dump of the module it wrote."""
    before = set(Path(DUMP).glob("*-live-range.txt"))
    compile_fn()
    new = sorted(set(Path(DUMP).glob("*-live-range.txt")) - before,
                 key=lambda p: p.stat().st_size)
    if not new:
        raise SystemExit(f"XLA wrote no live-range dump to {DUMP}")
    return Dump(new[-1])


def strategy_row(word: str, layers: int, kind: str) -> tuple[Dump, int]:
    p, loss_fn, micro, k = job.job_of(layers, kind)
    acc = axj.Accelerator(strategy=job.strategy(word), precision="fp32", grad_accum_steps=k)
    state = acc.setup(p, optax.adam(1e-3))
    step = acc.train_step(loss_fn)
    window = acc.window([micro(job.GPT_ROWS * acc.local_devices) for _ in range(k)])
    measured = []

    def compile_step() -> None:
        stats = step.lower(state, window).compile(job.MEMORY_ONLY).memory_analysis()
        measured.append(stats.argument_size_in_bytes + stats.temp_size_in_bytes)
    return compiled_dump(compile_step), measured[0]


def plain_row(layers: int, kind: str) -> tuple[Dump, int]:
    p, loss_fn, micro, _ = job.job_of(layers, kind)
    rows = micro(job.GPT_ROWS)

    def plain_grad(q):  # the module's name in the dump: jit_plain_grad
        return jax.grad(lambda q: loss_fn(q, rows, jax.random.key(0)))(q)
    temp = []

    def compile_plain() -> None:
        compiled = jax.jit(plain_grad).lower(jax.tree.map(jnp.asarray, p)).compile(
            job.MEMORY_ONLY)
        temp.append(compiled.memory_analysis().temp_size_in_bytes)
    return compiled_dump(compile_plain), temp[0]


def _mib(size: int, ddp: int | None) -> str:
    """MiB, and the ratio to ddp's measured bytes once ddp has a row."""
    return f"{size / MIB:.1f}" + (f" ({size / ddp:.3f}x)" if ddp else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--job", default="gpt", choices=("gpt", "gpt-scan"))
    parser.add_argument("--strategies", nargs="+", default=["ddp", "fsdp", "fsdp-sync"])
    args = parser.parse_args()
    try:
        plain, plain_temp = plain_row(args.layers, args.job)
        _, activations, parked = plain.activation_peak()
        print(machine_line())
        said = (f"plain JAX ({args.job}, {args.layers} layers, one device's rows): temp_size "
                f"{plain_temp / MIB:.2f} MiB")
        if args.job == "gpt":  # a scan's body buffers share one live range: not summed here
            said += (f"; activations when its backward starts {activations / MIB:.2f} MiB, "
                     f"{parked / MIB:.2f} of them in the buffers of the gradients it returns")
        print(said)
        rows, ddp = [], None
        for word in args.strategies:
            dump, measured = strategy_row(word, args.layers, args.job)
            live = dump.peak_parts()
            ddp = measured if word == "ddp" else ddp
            floor = (live.get("arguments", 0) + live.get("carried", 0)
                     + live.get("activations", 0) + live.get("gathered", 0))
            packing = dump.arguments + dump.temp - sum(live.values())
            rows.append([word, _mib(measured, ddp),
                         *(f"{live.get(part, 0) / MIB:.1f}" for part in PARTS),
                         f"{packing / MIB:.1f}", _mib(floor, ddp)])
        print(markdown_table(["strategy", "measured", *PARTS, "packing", "floor"], rows))
    finally:
        shutil.rmtree(DUMP, ignore_errors=True)


if __name__ == "__main__":
    main()
