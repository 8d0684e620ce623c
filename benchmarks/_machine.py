"""What the benchmarks ran on, where they keep their scratch files, and their logs.

Scratch stores go on a real disk: fsync on tmpfs costs nothing and would flatter every
durable figure. The directory is ``$STALWART_BENCH_DIR`` when set, else the system temp
directory unless that is a RAM filesystem, else the current directory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import sqlite3
import sys
import tempfile
from collections.abc import Iterator
from importlib import metadata
from typing import Any

import lmdb
import structlog

_RAM_FILESYSTEMS = {"tmpfs", "ramfs"}


def _mount_of(path: str) -> tuple[str, str, str]:
    """``(mount point, filesystem type, device)`` holding ``path`` (Linux; else unknown)."""
    path = os.path.realpath(path)
    best = ("", "unknown", "unknown")
    try:
        with open("/proc/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                device, point, fstype, *_ = line.split()
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best[0]):
                    best = (point, fstype, device)
    except OSError:
        pass
    return best


def scratch_root() -> str:
    """The directory scratch stores are made in (see the module docstring)."""
    chosen = os.environ.get("STALWART_BENCH_DIR")
    if chosen:
        return os.path.abspath(chosen)
    temp = tempfile.gettempdir()
    if _mount_of(temp)[1] in _RAM_FILESYSTEMS:
        return os.getcwd()
    return temp


def scratch() -> tempfile.TemporaryDirectory[str]:
    """A fresh temporary directory on the scratch filesystem; use it as a context manager."""
    return tempfile.TemporaryDirectory(prefix="stalwart-bench-", dir=scratch_root())


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _memory() -> str:
    try:
        with open("/proc/meminfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("MemTotal:"):
                    return f"{int(line.split()[1]) / (1 << 20):.1f} GiB"
    except OSError:
        pass
    return "unknown"


def machine(*, quick: bool) -> dict[str, Any]:
    """The machine and the conditions of this run, recorded with every result."""
    root = scratch_root()
    point, fstype, device = _mount_of(root)
    return {
        "cpu_count": os.cpu_count(),
        "memory": _memory(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "lmdb": f"py-lmdb {lmdb.__version__}, LMDB {'.'.join(map(str, lmdb.version()[:3]))}",
        "msgspec": _version("msgspec"),
        "eventsourcing": _version("eventsourcing"),
        "sqlite": sqlite3.sqlite_version,
        "scratch_dir": root,
        "scratch_fs": f"{fstype} on {device} (mounted at {point or '?'})",
        "quick": quick,
    }


def quiet_structlog(level: int = logging.ERROR) -> None:
    """structlog set to print only ``level`` and above, on stderr (a line per event would
    cost CPU in the measurement, and stdout carries ``--json``'s lines)."""
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


@contextlib.contextmanager
def quiet_logs(level: int = logging.ERROR) -> Iterator[None]:
    """:func:`quiet_structlog` for a block, then structlog as it was: unconfigured again if
    it was, so that stalwart's lines go back to ``logging`` (restoring the default
    configuration would mark structlog configured, and every later benchmark's INFO
    lines would land on stdout)."""
    configured, saved = structlog.is_configured(), structlog.get_config()
    quiet_structlog(level)
    try:
        yield
    finally:
        if configured:
            structlog.configure(**saved)
        else:
            structlog.reset_defaults()
