"""The ``stalwart`` command line."""

from . import _check, _demo, _fake, _incidents, _run  # noqa: F401  (they register their commands)
from ._app import cli, main

__all__ = ["cli", "main"]
