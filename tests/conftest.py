"""Every test leaves no process group and no changed environment behind.

The session's processes (this one, spawned ranks, CLI jobs) share one XLA compilation cache,
created here and removed at the end: a JAX step that another test, rank or restarted job already
compiled is read back instead of compiled again (compiling is most of a JAX test's time). The
executable read back is the one XLA built for the same program, flags and devices, so results
and ``memory_analysis()`` are the same; the in-memory jit cache (which tests count) is untouched.
"""

from __future__ import annotations

import os
import shutil
import tempfile

# Two CPU devices for accumix.jax's multi-device tests; must be set before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
_JAX_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _JAX_CACHE = tempfile.mkdtemp(prefix="accumix-test-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _JAX_CACHE
    # Compilations of 0.1 s and more (the default, 1 s, skips most of these tiny models' steps).
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
    # A size bound turns on JAX's file lock around reads and writes: two ranks may write the same
    # entry while a third process reads it (without the lock a reader can see a partial file).
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 * 2**30))
# The suite launches 2 (and 2 x 2) processes whatever the machine's cores: `accumix launch`
# refuses more processes than cores unless told (tests/unit/test_security_config.py checks it).
os.environ.setdefault("ACCUMIX_OVERSUBSCRIBE", "1")

# A cluster engine's variables (the suite run inside a Kubernetes pod or on a SkyPilot node)
# would make every launch and every spawned rank join the engine's job: the tests that want
# them set them.
for _name in [n for n in os.environ if n.startswith(("PET_", "SKYPILOT_")) or n in (
        "KUBERNETES_SERVICE_HOST", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
        "JAX_COORDINATOR_ADDRESS")]:
    del os.environ[_name]

from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402


def pytest_unconfigure(config: pytest.Config) -> None:
    if _JAX_CACHE is not None:
        shutil.rmtree(_JAX_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def _clean_process_state():
    saved = dict(os.environ)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[dict[str, str]]:
    """One local S3 server (moto, in this process, on loopback) for the whole session: the
    environment s3fs reads (``AWS_ENDPOINT_URL`` and credentials), for this process (the
    ``s3`` fixture) and for the ranks and jobs it starts (pass it in their environment)."""
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    server.stop()


@pytest.fixture
def s3(s3_server: dict[str, str], monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
       ) -> str:
    """A fresh bucket on the session's S3 server, its URL (``s3://<bucket>``); this process's
    environment points s3fs at the server for the test."""
    import s3fs

    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()  # an instance made for another endpoint
    name = "".join(c if c.isalnum() else "-" for c in request.node.name.lower())
    bucket = f"t-{name[:50]}".rstrip("-")
    s3fs.S3FileSystem(use_listings_cache=False).mkdir(bucket)
    return f"s3://{bucket}"
