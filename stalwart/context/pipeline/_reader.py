"""A :data:`FileReader` confined to one directory: what a host gives the pipeline engine
(``Runtime(file_reader=directory_reader(root))``) so that layer 9 can read files again."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ._run import FileReader

__all__ = ["directory_reader"]

#: The most of a file :func:`directory_reader` reads (layer 9 clips far below this).
MAX_BYTES = 1_000_000


def directory_reader(root: str | os.PathLike[str], *, max_bytes: int = MAX_BYTES) -> FileReader:
    """A reader of the files under ``root``, for layer 9 (rehydration).

    The paths come from the model's own tool calls, so they are untrusted: a relative
    path is taken under ``root``, an absolute one only when it lies under ``root``, and
    one that leaves it (``..``, a symbolic link pointing out) reads as missing (None), as
    does anything that is not a regular file or cannot be read. At most ``max_bytes``
    are read; bytes that are not UTF-8 become U+FFFD.

    The file is opened one directory at a time from ``root``, following no symbolic
    link and without waiting, and checked to be a regular file once open: a link or a
    FIFO swapped in after the path was resolved reads as missing, instead of reading
    outside ``root`` or hanging the ContextStore's lane on a FIFO no one writes."""
    base = Path(root).resolve()

    def read(path: str) -> str | None:
        try:
            target = (base / path).resolve()
            if not target.is_relative_to(base):
                return None
            data = _read_under(base, target.relative_to(base).parts, max_bytes)
        except (OSError, ValueError, RuntimeError):
            # unreadable, a path with a NUL in it, or a loop of symbolic links (which
            # ``resolve`` raises as RuntimeError before Python 3.13)
            return None
        return None if data is None else data.decode("utf-8", errors="replace")

    return read


_NO_FOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)


def _read_under(base: Path, parts: tuple[str, ...], max_bytes: int) -> bytes | None:
    """At most ``max_bytes`` of the regular file at ``parts`` under ``base`` (a resolved
    path: it names no symbolic link), opened component by component with no link
    followed (OSError if one is met); None when it is not a regular file."""
    if not parts:
        return None  # the root itself
    directory = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | _NO_FOLLOW, dir_fd=directory)
            os.close(directory)
            directory = inner
        fd = os.open(parts[-1], os.O_RDONLY | os.O_NONBLOCK | _NO_FOLLOW, dir_fd=directory)
    finally:
        os.close(directory)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks: list[bytes] = []
        left = max_bytes
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
