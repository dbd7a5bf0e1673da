"""Where a run directory is: a local path, or an fsspec URL (``s3://``, ``gs://``, ``az://``).

``location(run_dir)`` is the one place that tells them apart:

* ``file://`` URLs are local paths;
* another URL is a ``RemotePath`` on its fsspec filesystem (s3fs, gcsfs, adlfs: credentials and
  endpoint from that library's usual environment, e.g. ``AWS_*`` and ``AWS_ENDPOINT_URL``;
  accumix never logs or stores them); a protocol whose library is missing, or unknown, is
  refused in one line;
* a local path whose first part is a known protocol and a colon (``s3:/bucket/job``) is a URL
  that ``pathlib.Path`` collapsed (it joins ``//`` into ``/``): refused, where it would have
  written a local folder ``./s3:/bucket/job`` and resumed from it.

``RemotePath`` has the part of ``pathlib.Path``'s interface the checkpoints use (joining,
names, reading and writing whole files, listing), and deliberately no ``__fspath__``: handed to
``open()`` or ``os`` by mistake it raises instead of writing a local file. Listings are never
cached (``use_listings_cache=False``): another process's writes are seen at once.
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import IO, Any

from accumix.errors import ConfigError

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.DOTALL)
_LOCAL_PROTOCOLS = ("file", "local")
# Passed to every fsspec filesystem accumix opens: no stale listing after another rank wrote.
STORAGE_OPTIONS: dict[str, Any] = {"use_listings_cache": False}


def is_url(run_dir: str | os.PathLike[str] | RemotePath) -> bool:
    """Whether ``run_dir`` names an object store (a non-local fsspec URL)."""
    if isinstance(run_dir, RemotePath):
        return True
    match = _URL.match(str(run_dir)) if isinstance(run_dir, str) else None
    return match is not None and match.group(1).lower() not in _LOCAL_PROTOCOLS


def location(run_dir: str | os.PathLike[str] | RemotePath, what: str = "run_dir"
             ) -> Path | RemotePath:
    """``run_dir`` as a local ``Path`` or a ``RemotePath``.

    Raises:
        ConfigError: a URL whose fsspec library is not installed or whose protocol is
            unknown, or a URL collapsed by ``pathlib`` (one line naming what to pass).
    """
    if isinstance(run_dir, RemotePath):
        return run_dir
    text = os.fspath(run_dir)
    match = _URL.match(text) if isinstance(run_dir, str) else None
    if match is not None:
        protocol = match.group(1).lower()
        if protocol in _LOCAL_PROTOCOLS:
            return Path(match.group(2))
        return RemotePath.from_url(text, what)
    _refuse_collapsed_url(text, what)
    return Path(text)


def _refuse_collapsed_url(text: str, what: str) -> None:
    head, _, rest = text.partition(":/")
    if not rest or "/" in head or not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", head):
        return
    from fsspec.registry import known_implementations

    if head.lower() in known_implementations and head.lower() not in _LOCAL_PROTOCOLS:
        raise ConfigError(
            f"{what}={text!r} looks like the URL '{head}://{rest.lstrip('/')}' with a slash "
            "lost (pathlib.Path joins '//' into '/'); pass the URL as a string, not a Path")


class RemotePath:
    """A file or directory in an fsspec filesystem, with a small ``pathlib``-like interface.

    Args:
        fs: the fsspec filesystem.
        protocol: the URL's protocol (``s3``), for ``str()``.
        path: the path inside ``fs`` (``bucket/job/step-3``), without a trailing slash.
    """

    __slots__ = ("fs", "path", "protocol")

    def __init__(self, fs: Any, protocol: str, path: str) -> None:
        self.fs, self.protocol, self.path = fs, protocol, path.rstrip("/")

    @classmethod
    def from_url(cls, url: str, what: str = "run_dir") -> RemotePath:
        """The ``RemotePath`` of ``url`` (``s3://bucket/job``).

        Raises:
            ConfigError: the protocol's library is missing, or the protocol is unknown.
        """
        import fsspec

        protocol = url.split("://", 1)[0].lower()
        try:
            fs, path = fsspec.core.url_to_fs(url, **STORAGE_OPTIONS)
        except ImportError as exc:
            extra = " (pip install 'accumix[s3]')" if protocol in ("s3", "s3a") else ""
            raise ConfigError(f"{what}={url!r} needs the fsspec library for {protocol}://: "
                              f"{exc}{extra}") from None
        except ValueError as exc:
            raise ConfigError(f"{what}={url!r}: {exc}; give a local path or a URL of an "
                              "fsspec filesystem (s3://, gs://, az://)") from None
        return cls(fs, protocol, path)

    # -- names --------------------------------------------------------------------------------
    def __str__(self) -> str:
        return f"{self.protocol}://{self.path}"

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and str(other) == str(self)

    def __hash__(self) -> int:
        return hash(str(self))

    def __truediv__(self, part: str) -> RemotePath:
        return RemotePath(self.fs, self.protocol, posixpath.join(self.path, str(part)))

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    @property
    def parent(self) -> RemotePath:
        return RemotePath(self.fs, self.protocol, posixpath.dirname(self.path))

    def with_name(self, name: str) -> RemotePath:
        return self.parent / name

    def relative_to(self, other: RemotePath) -> str:
        return posixpath.relpath(self.path, other.path)

    # -- queries ------------------------------------------------------------------------------
    def exists(self) -> bool:
        return bool(self.fs.exists(self.path))

    def is_file(self) -> bool:
        return bool(self.fs.isfile(self.path))

    def is_dir(self) -> bool:
        return bool(self.fs.isdir(self.path))

    def stat(self) -> SimpleNamespace:
        return SimpleNamespace(st_size=int(self.fs.info(self.path)["size"]))

    def iterdir(self) -> Iterator[RemotePath]:
        """The entries below this prefix (none when nothing was written there yet)."""
        try:
            entries = self.fs.ls(self.path, detail=False)
        except FileNotFoundError:
            entries = []
        for entry in entries:
            yield RemotePath(self.fs, self.protocol, entry)

    def glob(self, pattern: str) -> Iterator[RemotePath]:
        for entry in self.fs.glob(posixpath.join(self.path, pattern)):
            yield RemotePath(self.fs, self.protocol, entry)

    def sizes(self) -> dict[str, int]:
        """Every file below this directory with its size, by relative name (one listing)."""
        found = self.fs.find(self.path, detail=True)
        return {posixpath.relpath(name, self.path): int(info["size"])
                for name, info in found.items() if info.get("type") != "directory"}

    # -- whole files --------------------------------------------------------------------------
    def open(self, mode: str = "rb") -> IO[Any]:
        return self.fs.open(self.path, mode)

    def read_bytes(self) -> bytes:
        return bytes(self.fs.cat_file(self.path))

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def write_bytes(self, data: bytes) -> None:
        """One object written whole: readers see the old one or this one, never a part."""
        self.fs.pipe_file(self.path, data)

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode())

    def mkdir(self, parents: bool = True, exist_ok: bool = True) -> None:
        del parents  # a prefix needs no parents; a bucket is created if the store allows
        self.fs.makedirs(self.path, exist_ok=exist_ok)

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self.fs.rm_file(self.path)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def rmtree(self) -> None:
        """Removes every object below this prefix (none there: nothing happens)."""
        if self.fs.exists(self.path):
            self.fs.rm(self.path, recursive=True)


AnyPath = Path | RemotePath
