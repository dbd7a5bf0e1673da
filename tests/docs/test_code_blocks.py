"""Every runnable code block of README.md, docs/ and the public docstrings runs as written.

One test per page (its blocks share a scratch directory, in page order); the conventions are in
``blocks.py``. After some pages, what their commands left behind is checked (``AFTER``).
"""

from __future__ import annotations

import os
import re
import resource
import runpy
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from accumix.cli.main import main
from accumix.testing import free_port
from tests.docs.blocks import Block, Source, sources

SHORT = ["max_steps=4", "eval_every=2", "model.n_layer=1", "model.n_embd=32", "model.n_head=2",
         "model.block_size=32", "data.max_files=8", "data.max_val_bytes=2000",
         "sample.max_new_tokens=8", "nproc=1", "progress_bar=false"]

SOURCES = [s for s in sources() if s.runnable]
MASTER_PORT = re.compile(r"--master-port \d+")


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    # One thread per process: these jobs are tiny, and OpenMP threads that wait on each other
    # on a busy 2-core machine make them many times slower.
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class PageRun:
    """Runs one source's blocks in order in ``directory``; records what ran and how long."""

    def __init__(self, source: Source, directory: Path,
                 capsys: pytest.CaptureFixture[str]) -> None:
        self.source = source
        self.directory = directory
        self.capsys = capsys
        self.env = _environment()
        self.ran: list[str] = []
        self.output: dict[str, str] = {}  # each command's stdout
        self.seconds: dict[str, float] = {}
        self.background: list[tuple[str, subprocess.Popen[str]]] = []
        self.port = free_port()
        self.namespace: dict[str, Any] = {}
        self.files = {b.file_name for b in source.blocks if b.file_name}

    def where(self, block: Block) -> str:
        return f"{self.source.name}:{block.line}"

    def timed(self, label: str, fn: Callable[[], None]) -> None:
        started = time.perf_counter()
        fn()
        self.seconds[label] = time.perf_counter() - started

    def accumix(self, argv: list[str]) -> tuple[int, str]:
        if argv[:1] == ["train"] and "--print-config" not in argv:
            argv = [*argv, *SHORT]
        code = main(argv)
        return code, self.capsys.readouterr().err

    def python(self, block: Block) -> None:
        if "continuation" not in block.words:
            self.namespace = {"__name__": "__main__"}
        code = compile("\n" * (block.line) + block.body, self.where(block), "exec")
        self.timed(self.where(block), lambda: exec(code, self.namespace))

    def shell(self, block: Block) -> None:
        for line in block.body.splitlines():
            command = line.split("  #")[0].strip()
            if not command or command.startswith(("#", "make ")):
                continue
            self.ran.append(command)
            self.timed(command, lambda command=command: self.command(command, block))

    def command(self, command: str, block: Block) -> None:
        if command == "wait":
            for label, proc in self.background:
                out, err = proc.communicate(timeout=300)
                assert proc.returncode == 0, (self.where(block), proc.args, err[-3000:])
                self.output[label] = out
            self.background.clear()
            return
        label = command
        # A page's fixed port (what a reader types) becomes a free one here: other jobs share
        # this machine. The same free port for every command of the page, as they meet on it.
        command = MASTER_PORT.sub(f"--master-port {self.port}", command)
        words = shlex.split(command.rstrip("&"))
        if words[0] == "accumix" and words[1] != "launch":
            code, err = self.accumix(words[1:])
            assert code == 0, (self.where(block), command, err)
        elif words[0] == "python" and len(words) == 2 and words[1] in self.files:
            # The page's own script, in this process: the same program without a second
            # interpreter importing torch (seconds of CPU on a 2-core machine).
            self.capsys.readouterr()
            runpy.run_path(words[1], run_name="__main__")
            self.output[label] = self.capsys.readouterr().out
        elif command.endswith("&"):
            self.background.append((label, subprocess.Popen(
                command.rstrip("&"), shell=True, env=self.env, text=True,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)))
        else:
            done = subprocess.run(command, shell=True, env=self.env, text=True,
                                  capture_output=True, timeout=300)
            assert done.returncode == 0, (self.where(block), command, done.stderr[-3000:])
            self.output[label] = done.stdout

    def failing_commands(self, block: Block) -> None:
        lines = block.body.splitlines()
        for i, line in enumerate(lines):
            if line.startswith("$ accumix "):
                self.ran.append(line[2:])
                code, err = self.accumix(shlex.split(line)[2:])
                assert (code, err) == (2, lines[i + 1] + "\n"), self.where(block)

    def run(self) -> None:
        files = {b.file_name: b for b in self.source.blocks if b.file_name}
        for name, block in files.items():
            (self.directory / name).write_text(block.body)
        for block in self.source.blocks:
            if not block.runs or block.file_name:
                continue
            if block.language in ("py", "python", "python3"):
                self.python(block)
            elif block.language == "text":
                self.failing_commands(block)
            else:
                self.shell(block)
        assert not self.background, f"{self.source.name}: a background command was not waited"
        for name, block in files.items():
            if block.runs and name.endswith(".py") and not any(name in c for c in self.ran):
                self.timed(name, lambda name=name: runpy.run_path(name, run_name="__main__"))
                self.ran.append(name)


def _readme(run: PageRun) -> None:
    # The loop ran on one process and on two: the same 10 optimizer steps of 16 documents,
    # K following the number of processes. (The two-"machine" launch beside it is
    # tests/distributed/test_launch.py's: four more processes would double this test's time.)
    assert "1 process(es), K=4, 10 optimizer steps" in run.output["python train.py"]
    two = run.output["accumix launch --nproc 2 train.py"]
    assert "2 process(es), K=2, 10 optimizer steps" in two


def _accumix_train(run: PageRun) -> None:
    # Each command's run ended where SHORT ends it, and left its outputs.
    assert (run.directory / "runs/quick/metrics.png").exists()
    assert (run.directory / "runs/gpt-stdlib/latest").read_text().strip() == "step-4"
    rows = (run.directory / "runs/job/metrics.csv").read_text().splitlines()
    assert [row.split(",")[0] for row in rows[1:]] == ["1", "2", "3", "4"]


def _trainer(run: PageRun) -> None:
    assert (run.directory / "runs/readme/latest").read_text().strip() == "step-20"


def _jax_loop(run: PageRun) -> None:
    assert (run.directory / "runs/jax-loop/latest").read_text().strip() == "step-40"


# What some pages' commands must leave behind, beyond every command's exit status.
AFTER: dict[str, Callable[[PageRun], None]] = {
    "README.md": _readme,
    "docs/get-started/accumix-train.md": _accumix_train,
    "docs/guides/trainer.md": _trainer,
    "docs/get-started/jax-loop.md": _jax_loop,
}


@pytest.mark.parametrize("source", SOURCES, ids=[s.name for s in SOURCES])
def test_code_blocks_run_as_written(source: Source, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str],
                                    one_thread: None) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # a block may import a file an earlier one wrote
    run = PageRun(source, tmp_path, capsys)
    cpu = time.process_time(), resource.getrusage(resource.RUSAGE_CHILDREN)
    run.run()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    run.seconds["CPU here"] = time.process_time() - cpu[0]
    run.seconds["CPU in processes"] = (children.ru_utime + children.ru_stime
                                       - cpu[1].ru_utime - cpu[1].ru_stime)
    if source.name in AFTER:
        AFTER[source.name](run)
    slow = sorted(run.seconds.items(), key=lambda kv: -kv[1])[:5]
    print(source.name, ", ".join(f"{label}: {s:.1f}s" for label, s in slow))


def test_every_page_with_code_is_collected() -> None:
    """The pages whose blocks run here include README.md, the get-started pages and the
    guides that promise an example runs; a page whose every block became an illustration
    would drop out of ``SOURCES`` silently otherwise."""
    names = {s.name for s in SOURCES}
    must = {"README.md", "docs/get-started/first-loop.md", "docs/get-started/accumix-train.md",
            "docs/get-started/jax-loop.md", "docs/concepts/exactness.md",
            "docs/guides/checkpoints.md", "docs/guides/trainer.md"}
    assert must <= names, sorted(must - names)
