"""The ``stalwart`` command line."""

from . import (  # noqa: F401  (they register their commands)
    _check,
    _context,
    _db,
    _demo,
    _fake,
    _incidents,
    _run,
    _session,
    _status,
    _watch,
    _worker,
)
from ._app import cli, main

__all__ = ["cli", "main"]
