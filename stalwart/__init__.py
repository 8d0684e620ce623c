"""stalwart: keeps long-running LLM agents from going quietly stuck.

An event-sourced runtime: every fact and decision is an event in one durable log, state
is a fold over it, and decisions are pure functions of that state.
"""

from __future__ import annotations

__all__ = ["__version__"]


def __getattr__(name: str) -> str:
    """``__version__``, read from the installed package's metadata when first asked
    (importing ``importlib.metadata`` costs the ``stalwart`` command's first tens of
    milliseconds, in which a Ctrl-C could only print a traceback)."""
    if name != "__version__":
        raise AttributeError(f"module 'stalwart' has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415  (lazy)

    try:
        found = version("stalwart")
    except PackageNotFoundError:  # running from a source tree that was not installed
        found = "0.0.0+unknown"
    globals()["__version__"] = found
    return found
