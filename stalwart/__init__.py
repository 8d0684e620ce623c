"""stalwart: keeps long-running LLM agents from going quietly stuck.

An event-sourced runtime: every fact and decision is an event in one durable log, state
is a fold over it, and decisions are pure functions of that state.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("stalwart")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
