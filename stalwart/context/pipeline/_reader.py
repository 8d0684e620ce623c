"""A :data:`FileReader` confined to one directory: what a host gives the pipeline engine
(``Runtime(file_reader=directory_reader(root))``) so that layer 9 can read files again."""

from __future__ import annotations

import os
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
    are read; bytes that are not UTF-8 become U+FFFD."""
    base = Path(root).resolve()

    def read(path: str) -> str | None:
        try:
            target = (base / path).resolve()
            if not target.is_relative_to(base) or not target.is_file():
                return None
            with target.open("rb") as file:
                data = file.read(max_bytes)
        except (OSError, ValueError, RuntimeError):
            # unreadable, a path with a NUL in it, or a loop of symbolic links (which
            # ``resolve`` raises as RuntimeError before Python 3.13)
            return None
        return data.decode("utf-8", errors="replace")

    return read
