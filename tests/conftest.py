from __future__ import annotations

import fcntl
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import pykka
import pytest
import structlog
import structlog.testing
from hypothesis import settings

from stalwart import store as store_module
from stalwart.actors import IoPortal, Scheduler
from stalwart.channels import MemoryChannel
from stalwart.cli import _logging as cli_logging
from stalwart.clock import FakeClock
from stalwart.runtime import Runtime
from stalwart.store import EventStore
from stalwart.testing import Answer, FakeProvider

from ._postgres import pg_server, pg_url  # noqa: F401  (one PostgreSQL cluster per session)
from ._relay import pg_store, relay, relayed_store  # noqa: F401  (a database that goes away)
from ._runtime_support import GUARD, runtime_config

# A property that fails prints the blob that replays its example
# (``@reproduce_failure``): a failure seen once in a CI log can be rerun, though the
# example database is not kept between runs.
settings.register_profile("stalwart", print_blob=True)
settings.load_profile("stalwart")


@pytest.fixture(autouse=True)
def _fresh_logging() -> Iterator[None]:
    """A test that configures structlog (the CLI does, run in-process) leaves it as a
    host that configured nothing would have it, for the next test."""
    root = logging.getLogger()
    level = root.level
    yield
    structlog.reset_defaults()
    root.removeHandler(cli_logging._HANDLER)  # the CLI's, run in-process
    root.setLevel(level)


@pytest.fixture
def logs() -> Iterator[list[MutableMapping[str, Any]]]:
    """Every log call of the library, whatever an earlier test configured (the CLI's level)."""
    saved = structlog.get_config()
    structlog.reset_defaults()
    try:
        with structlog.testing.capture_logs() as captured:
            yield captured
    finally:
        structlog.configure(**saved)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(start=1_800_000_000.0)


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def lmdb_store(store_dir: Path, clock: FakeClock) -> Iterator[EventStore]:
    store = store_module.open(store_dir, clock=clock)
    try:
        yield store
    finally:
        store.close()


# -- the runtime's tests: a store on the fake clock, a fake provider, a chat channel --------


@pytest.fixture
def store(tmp_path: Path, clock: FakeClock) -> Iterator[EventStore]:
    opened = store_module.open(tmp_path / "store", clock=clock)
    try:
        yield opened
    finally:
        opened.close()


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    with FakeProvider() as provider:
        provider.set_default(Answer(text="default answer"))
        yield provider


@pytest.fixture
def chat() -> MemoryChannel:
    return MemoryChannel("chat")


# -- one ``stalwart demo``, for the tests that read what it printed and logged ----------------


#: the one ``stalwart demo`` run's log directory: its path holds a space (the closing
#: commands it prints quote it)
DEMO_DIR = "demo log"


def _play_demo(directory: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stalwart", "--store", str(directory), "demo"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _shared_demo(shared: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The demo the pytest-xdist workers share: the first to ask plays it into
    ``shared`` under a file lock, a later one reads what it printed from there."""
    shared.mkdir(exist_ok=True)
    directory, printed = shared / DEMO_DIR, shared / "printed.json"
    with (shared / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released as the file closes
        if not printed.exists():
            proc = _play_demo(directory)
            seen = {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
            printed.write_text(json.dumps(seen))
        seen = json.loads(printed.read_text())
    proc = subprocess.CompletedProcess(
        [sys.executable, "-m", "stalwart", "--store", str(directory), "demo"],
        seen["returncode"],
        seen["stdout"],
        seen["stderr"],
    )
    return proc, directory


@pytest.fixture(scope="session")
def demo_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``stalwart demo`` run once in a real subprocess (it plays its scenes in real time,
    about 18 s) into a fresh directory whose path holds a space: what it printed, and the
    directory holding its log. One run serves the whole test session, its xdist workers
    included (each session's workers share the parent of their temporary directories).
    The tests that read them only read (the commands it prints only read too)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        directory = tmp_path_factory.mktemp("demo") / DEMO_DIR
        return _play_demo(directory), directory
    return _shared_demo(tmp_path_factory.getbasetemp().parent / "stalwart-demo-run")


@pytest.fixture
def rt(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> Iterator[Runtime]:
    """A runtime on the fake provider (``runtime_config``'s defaults) with the ``chat``
    channel; a test module that needs another defines its own ``rt``."""
    config = runtime_config(fake.base_url)
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        yield rt


@pytest.fixture
def scheduler(clock: FakeClock) -> Iterator[Scheduler]:
    """A scheduler on the test's fake clock, stopped at teardown."""
    with Scheduler(clock) as started:
        yield started


@pytest.fixture
def portal() -> Iterator[IoPortal]:
    """An I/O loop for sends and tools, stopped at teardown."""
    with IoPortal() as running:
        yield running


@pytest.fixture
def actors() -> Iterator[list[pykka.ActorRef[Any]]]:
    """Actors a test starts; all stopped at teardown."""
    refs: list[pykka.ActorRef[Any]] = []
    try:
        yield refs
    finally:
        for ref in refs:
            ref.stop(block=True, timeout=GUARD)
