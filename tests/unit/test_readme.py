"""README.md's examples run as written, in README order, in a short configuration.

* A fenced block whose first line is ``# <file>.py`` or ``# <file>.yaml`` is written to that
  file first, for the commands; a Python file that no command runs is run at the end.
  Blocks without a file name are fragments (the loop of the core section).
* Every line of a ``bash`` block is run in the same directory; ``&`` runs it in the background
  until ``wait``. ``make`` lines are left out: they are the project's own entry points (CI runs
  ``make test``; ``make run`` is ``accumix train``, run here).
* ``accumix train`` runs shortened (SHORT below, one process); ``accumix`` commands other than
  ``launch`` run in this process, the rest as real processes.
* A ``text`` block of ``$ command`` lines checks the printed output.
"""

from __future__ import annotations

import os
import re
import runpy
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from accumix.cli.main import main

README = Path(__file__).resolve().parents[2] / "README.md"
SHORT = ["max_steps=4", "eval_every=2", "model.n_layer=1", "model.n_embd=32", "model.n_head=2",
         "model.block_size=32", "data.max_files=8", "data.max_val_bytes=2000",
         "sample.max_new_tokens=8", "nproc=1", "progress_bar=false"]
FILE_HEADER = re.compile(r"^# ([\w.-]+\.(?:py|yaml))\b")


def blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced block, in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M)


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    # One thread per process: these jobs are tiny, and OpenMP threads that wait on each other
    # on a busy 2-core machine make them many times slower.
    env["OMP_NUM_THREADS"] = "1"
    return env


def _accumix_in_process(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    if argv[:1] == ["train"] and "--print-config" not in argv:
        argv = [*argv, *SHORT]
    code = main(argv)
    out = capsys.readouterr()
    return code, out.err


@pytest.fixture
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_readme_examples_run_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str],
                                        one_thread: None) -> None:
    monkeypatch.chdir(tmp_path)
    env = _environment()
    background: list[subprocess.Popen[str]] = []
    ran: list[str] = []
    readme = blocks(README.read_text())
    for language, body in readme:
        header = FILE_HEADER.match(body)
        if header and language in ("python", "yaml"):
            (tmp_path / header.group(1)).write_text(body)
    for language, body in readme:
        if language == "bash":
            for line in body.splitlines():
                command = line.split("  #")[0].strip()
                if not command or command.startswith(("#", "make ")):
                    continue
                ran.append(command)
                if command == "wait":
                    for proc in background:
                        out, err = proc.communicate(timeout=180)
                        assert proc.returncode == 0, (proc.args, err[-2000:])
                    background.clear()
                    continue
                words = shlex.split(command.rstrip("&"))
                if words[0] == "accumix" and words[1] != "launch":
                    code, err = _accumix_in_process(words[1:], capsys)
                    assert code == 0, (command, err)
                elif command.endswith("&"):
                    background.append(subprocess.Popen(
                        command.rstrip("&"), shell=True, env=env, text=True,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE))
                else:
                    done = subprocess.run(command, shell=True, env=env, text=True,
                                          capture_output=True, timeout=180)
                    assert done.returncode == 0, (command, done.stderr[-3000:])
        elif language == "text":
            lines = body.splitlines()
            for i, line in enumerate(lines):
                if line.startswith("$ accumix "):
                    ran.append(line[2:])
                    code, err = _accumix_in_process(shlex.split(line)[2:], capsys)
                    assert code == 2 and err == lines[i + 1] + "\n"
    assert not background
    for script in sorted(tmp_path.glob("*.py")):
        if not any(script.name in command for command in ran):
            runpy.run_path(str(script), run_name="__main__")
            ran.append(script.name)
    # What the commands left behind: the runs, their plots, the resumed checkpoint.
    assert (tmp_path / "runs/quick/metrics.png").exists()
    assert (tmp_path / "runs/job/metrics.csv").exists()
    assert (tmp_path / "runs/readme/latest").read_text().strip() == "step-20"
    assert "python train.py" in ran and any(c.startswith("accumix launch") for c in ran)
    assert "stop_when_good.py" in ran
