"""The ``stalwart`` command line."""

from . import _check  # noqa: F401  (registers the check command)
from ._app import cli, main

__all__ = ["cli", "main"]
