"""The ``stalwart`` command's entry point, light to import.

The CLI imports the whole runtime (about half a second). Loaded by the console script
itself, a Ctrl-C in that time printed a ``KeyboardInterrupt`` traceback; loaded here,
inside :func:`main`, it ends the command as a Ctrl-C does once the command runs: exit
130, no traceback.
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main() -> None:
    """Run the ``stalwart`` command (see :func:`stalwart.cli.main`)."""
    try:
        from stalwart.cli import main as run  # noqa: PLC0415  (caught below)
    except KeyboardInterrupt:
        sys.exit(130)
    run()
