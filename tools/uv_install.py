"""``uv pip install`` into a venv with the same package sources and caps as that venv's pip.

``make install`` uses it (uv resolves and installs in parallel: minutes faster than pip on the
project's extras). uv reads no pip configuration, and on the machines we build on pip's
configuration is what points at the local wheel folders and indexes and caps torch (a bare
``torch`` from PyPI is a multi-GB CUDA build): so this reads ``pip config list`` (files and
``PIP_*`` variables) at install time and passes each setting to uv. A pip setting it cannot
translate stops the install with its name (``make INSTALLER=pip`` installs with pip instead):
a silently dropped setting could change what gets installed. The torch already in the venv
(pip installs it first, from local disk) is pinned too, so uv never swaps it.

Usage: ``python tools/uv_install.py VENV_PYTHON UV [uv pip install arguments...]``
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

# pip settings and what uv takes for them (their values are whitespace-separated lists).
LISTS = {"extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}
# pip settings with no bearing on what gets installed.
HARMLESS = {"disable-pip-version-check", "quiet", "verbose", "progress-bar", "no-color",
            "root-user-action", "no-input", "cache-dir", "no-cache-dir", "retries"}
LINE = re.compile(r"^(?P<section>[^.\s]*)\.(?P<key>[^=\s]+)='(?P<value>.*)'$")


def pip_settings(python: str) -> dict[str, str]:
    """pip's effective settings for ``install``: a ``PIP_*`` variable over the ``install``
    section over the ``global`` one (pip's own order)."""
    out = subprocess.run([python, "-m", "pip", "config", "list"], check=True,
                         capture_output=True, text=True).stdout
    rank = {":env:": 2, "install": 1, "global": 0}
    found: dict[str, tuple[int, str]] = {}
    for line in out.splitlines():
        match = LINE.match(line.strip())
        if match is None or match["section"] not in rank:
            continue
        key, level = match["key"], rank[match["section"]]
        if key not in found or found[key][0] <= level:
            found[key] = (level, match["value"])
    return {key: value for key, (_, value) in found.items()}


def uv_arguments(settings: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The uv flags and environment for pip's ``settings``; raises SystemExit naming a setting
    uv would not honour."""
    args: list[str] = []
    env: dict[str, str] = {}
    for key, value in sorted(settings.items()):
        if key in LISTS:
            for item in value.split():
                args += [LISTS[key], item]
        elif key in ("index-url", "i"):
            args += ["--index-url", value]
        elif key == "no-index" and value.lower() in ("1", "true", "yes", "on"):
            args.append("--no-index")
        elif key == "cert":
            env["SSL_CERT_FILE"] = value
        elif key in ("default-timeout", "timeout"):
            env["UV_HTTP_TIMEOUT"] = str(int(float(value)))
        elif key not in HARMLESS:
            raise SystemExit(f"tools/uv_install.py: pip setting {key}={value!r} has no uv "
                             "translation here; install with pip instead: make INSTALLER=pip")
    # pip takes the best version across all its sources; uv's default takes the first index
    # that has a package at all.
    args += ["--index-strategy", "unsafe-best-match"]
    return args, env


def installed_torch(python: str) -> str | None:
    """The torch version installed in ``python``'s environment, or None."""
    proc = subprocess.run([python, "-c", "import importlib.metadata as m; "
                           "print(m.version('torch'))"], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


def main(argv: list[str]) -> int:
    python, uv, *rest = argv
    args, env = uv_arguments(pip_settings(python))
    with tempfile.TemporaryDirectory() as tmp:
        torch = installed_torch(python)
        if torch is not None:
            pin = os.path.join(tmp, "torch.txt")
            with open(pin, "w") as f:
                f.write(f"torch=={torch}\n")
            args += ["--constraint", pin]
        command = [uv, "pip", "install", "--python", python, *args, *rest]
        print("+", " ".join(command), flush=True)
        return subprocess.run(command, env={**os.environ, **env}).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
