"""Every test leaves no process group and no changed environment behind.

The session's processes (this one, spawned ranks, CLI jobs) share one XLA compilation cache,
created here and removed at the end: a JAX step that another test, rank or restarted job already
compiled is read back instead of compiled again (compiling is most of a JAX test's time). The
executable read back is the one XLA built for the same program, flags and devices, so results
and ``memory_analysis()`` are the same; the in-memory jit cache (which tests count) is untouched.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tests.xla_flags import xla_flags

# Two CPU devices for accumix.jax's multi-device tests; must be set before jax is imported.
os.environ.setdefault("XLA_FLAGS", xla_flags(2))  # and a faster compile (tests/xla_flags.py)
# Ray resolves 127.0.0.1 to the machine's public address (when imported) unless told that no
# other node will join (the variable speaks of Windows and macOS; it means "one node"): the
# session's Ray cluster then serves on loopback only.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
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

# The CPU's bf16 answer (``accumix.precision.words.cpu_has_native_bf16``: "auto"'s choice and
# the "emulated" warning) is pinned for the suite and every process it starts, through the
# probe's own override: a test may assume nothing of the CPU it runs on (issue 38: on a CPU
# with avx512_bf16 the "emulated" warning a test expected rightly never came). Tests of either
# answer ask for it (the ``cpu_bf16`` fixture).
os.environ["ACCUMIX_CPU_BF16"] = "0"

# A cluster engine's variables (the suite run inside a Kubernetes pod or on a SkyPilot node)
# would make every launch and every spawned rank join the engine's job: the tests that want
# them set them.
for _name in [n for n in os.environ if n.startswith(("PET_", "SKYPILOT_")) or n in (
        "KUBERNETES_SERVICE_HOST", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
        "JAX_COORDINATOR_ADDRESS")]:
    del os.environ[_name]

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402

# `make test` runs `pytest -n 2 --dist loadgroup`: tests without an xdist group go to whichever
# worker is free; a group runs on one worker. A shared resource that costs a spawn or a server
# must be made once, so every module that uses it is in its group (below).
# Helpers whose results are cached for the session and read by several modules (one spawn):
# a module that imports one shares its group.
SESSION_CACHES = ("hsdp_jobs", "micro_batch_jobs")
_IMPORTS = {h: re.compile(rf"\bimport {h}\b|\b{h} import\b") for h in SESSION_CACHES}
# Session fixtures that start something: each worker would start its own.
SESSION_FIXTURES = {"shared_spawn": "shared-spawn", "s3_server": "s3"}
# One local Ray cluster and one S3 server a session, also for files that use them by name only.
# ("test_ray_train.py", "test_s3_checkpoints.py", "test_remote_checkpoints.py"; not "array").
BY_FILE_NAME = ((re.compile(r"(^|_)ray(_|$)"), "ray"), (re.compile(r"(^|_)(s3|remote)(_|$)"), "s3"))


def _keys(item: pytest.Item, module: str, source: str) -> set[str]:
    """What ``item`` shares with other tests: resource names, or its module's path when it
    uses a module-scoped fixture (which a second worker would build again)."""
    keys = {helper for helper, imports in _IMPORTS.items() if imports.search(source)}
    stem = item.path.stem
    if stem.startswith("test_"):
        keys |= {key for pattern, key in BY_FILE_NAME if pattern.search(stem[5:])}
    if hasattr(getattr(item, "module", None), "shared_job"):
        keys.add("shared-spawn")
    fixtures = getattr(item, "_fixtureinfo", None)
    for name, defs in (fixtures.name2fixturedefs.items() if fixtures else ()):
        if name in SESSION_FIXTURES:
            keys.add(SESSION_FIXTURES[name])
        elif BY_FILE_NAME[0][0].search(name) and defs[-1].scope == "session":  # ray_cluster
            keys.add("ray")
        elif defs[-1].scope in ("module", "package", "class"):
            keys.add(module)
    return keys


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """One ``xdist_group`` per test: modules that share a key (a resource, a cached spawn,
    module-scoped fixtures) are joined, so each resource is made once, on one worker."""
    parent: dict[str, str] = {}

    def find(key: str) -> str:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    def union(a: str, b: str) -> None:
        a, b = find(a), find(b)
        if a != b:  # a resource's name names the group rather than a module's path
            a, b = sorted((a, b), key=lambda k: (k.startswith("tests/"), k))
            parent[b] = a

    sources: dict[str, str] = {}
    for item in items:
        module = item.nodeid.partition("::")[0]
        if module not in sources:
            sources[module] = item.path.read_text() if item.path.suffix == ".py" else ""
        for key in _keys(item, module, sources[module]):
            union(module, key)
    for item in items:
        module = item.nodeid.partition("::")[0]
        if module in parent:
            item.add_marker(pytest.mark.xdist_group(find(module)))


@pytest.hookimpl(trylast=True)  # after xdist's worker renamed each grouped test
def pytest_collection_finish(session: pytest.Session) -> None:
    """Stops a ``--dist loadgroup`` run whose groups xdist did not apply (pytest 9.2 ignores
    xdist 3.8's renaming): every shared job would then run once per worker."""
    if not getattr(session.config.option, "loadgroup", False):  # set on xdist workers only
        return
    for item in session.items:
        if item.get_closest_marker("xdist_group") and "@" not in item.nodeid.rpartition("]")[2]:
            raise pytest.UsageError(
                f"pytest-xdist did not group {item.nodeid} (pytest {pytest.__version__}): "
                "install the dev extra's pytest (pip install -e '.[dev]')")


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


# Ray Train's knobs for the session's cluster (read by the driver at fit() and propagated to
# Ray's controller and workers): the pre-emption watcher is one more actor per worker group and
# the tests hand its notice over themselves; metrics and the state actor's reconciliation are
# more processes and polling on a 2-core machine. The controller's poll (2 s by default) is
# also when it takes a worker's report: a worker's next report waits for it (a queue of one),
# and a dead worker is noticed then.
RAY_TRAIN_ENV = {
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_METRICS_ENABLED": "0",
    "RAY_TRAIN_ENABLE_STATE_ACTOR_RECONCILIATION": "0",
    "RAY_TRAIN_ENABLE_CONTROLLER_STRUCTURED_LOGGING": "0",
    "RAY_TRAIN_ENABLE_WORKER_STRUCTURED_LOGGING": "0",
}


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[dict[str, str]]:
    """One local Ray cluster for the session's Ray Train tests (one module: its scope ends the
    cluster when they are done, rather than leaving Ray's daemons polling on 2 cores for the
    rest of the session): 2 CPUs, every service on loopback.

    Yields the variables a test sets while it calls ``fit()`` (``RAY_TRAIN_ENV``). Skipped,
    with the reason, only when ray is not importable.
    """
    pytest.importorskip("ray.train", reason="ray[train] is not installed: pip install "
                        "'accumix[ray]' to run the Ray Train tests")
    import ray

    root = Path(__file__).resolve().parents[1]
    saved = dict(os.environ)
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    # Ray's log monitor lists its log directory every 0.1 s below 1000 files: every 5 s here.
    os.environ["RAY_LOG_MONITOR_MANY_FILES_THRESHOLD"] = "0"
    os.environ["LOG_NAME_UPDATE_INTERVAL_S"] = "5"
    # The workers import the tests' jobs (tests.ray_jobs) and the examples from this tree.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    os.environ.update(RAY_TRAIN_ENV)
    # ray.init installs its own SIGTERM/SIGINT handlers in this process and shutdown leaves
    # them: put back what was there, so later tests in this worker see their process as it was.
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        # address="local": a new cluster of this session's own, never one found through
        # RAY_ADDRESS or `ray start`'s /tmp/ray/ray_current_cluster (another session's).
        ray.init(address="local", num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False,
                 log_to_driver=False, object_store_memory=100 * 2**20)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        yield dict(RAY_TRAIN_ENV)
    finally:
        ray.shutdown()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


@pytest.fixture(params=[False, True], ids=["emulated-bf16", "native-bf16"])
def cpu_bf16(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[bool]:
    """Both answers of the CPU's bf16 probe, faked through its override (the test runs once
    for a CPU without native bf16, once for one with it); yields whether it is native."""
    from accumix.precision.words import cpu_has_native_bf16

    monkeypatch.setenv("ACCUMIX_CPU_BF16", "1" if request.param else "0")
    cpu_has_native_bf16.cache_clear()
    yield request.param
    cpu_has_native_bf16.cache_clear()  # the pinned answer again from the next call


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
