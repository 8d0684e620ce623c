"""``stalwart worker``: run activations from the store until stopped; ``stalwart session
send``: give a session a user message from the command line.

A worker is a :class:`~stalwart.runtime.Runtime` on the config's providers and channels
whose activation worker leases any session's due work in the store: run several (on one
machine, or on several hosts with a PostgreSQL store) and each activation is run by
exactly one of them at a time; a worker that dies has its work taken over after the
lease TTL. SIGTERM or SIGINT stops it cleanly (its wakes in flight are taken over).
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

import click

from stalwart.config import load_config
from stalwart.errors import StalwartError, StoreNotFoundError
from stalwart.events import SessionCreated
from stalwart.runtime import Runtime, check_session_id, send_message
from stalwart.store import EventStore
from stalwart.store import open as open_store

from ._app import DEFAULT_STORE, Seconds, _State, cli, message_text, session

#: How long the banner waits for the worker to say its owner name.
NAME_WAIT_S = 2.0


@cli.command()
@click.option(
    "--config",
    "config_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The runtime config (TOML, YAML or JSON): providers, agents, channels.",
)
@click.option(
    "--for",
    "seconds",
    type=Seconds(min=0),
    default=None,
    help="Stop after this many seconds (default: run until SIGTERM or Ctrl-C).",
)
@click.pass_obj
def worker(state: _State, config_path: Path, seconds: float | None) -> None:
    """Run the sessions' activations from the store until stopped."""
    config = load_config(config_path)
    store = state.store_for(config, create=True)
    stop = threading.Event()
    previous = {
        sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        with Runtime(config, store=store) as rt:
            name = _name(rt)
            click.echo(f"{name} on {store.location}", err=True)
            stop.wait(seconds)
            click.echo(f"{name} stopping", err=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        store.close()
    sys.stdout.flush()


def _name(rt: Runtime) -> str:
    """How the banner names the worker: by its owner (what its leases record), unless
    it is too busy to say within :data:`NAME_WAIT_S`, as when its first claim starts a
    wake for each of up to ``claim_batch`` (1,000) due sessions before it reads another
    message; it runs all the same."""
    try:
        return f"worker {rt.worker(timeout=NAME_WAIT_S).owner}"
    except TimeoutError:
        return "worker"


def _check_given(
    store: EventStore, session_id: str, agent: str | None, channel: str | None
) -> None:
    """``--agent`` / ``--channel`` given for a session that exists must be its own: its
    agent answers and its channel delivers whatever they say, so another one would be
    ignored without a word (as ``stalwart run`` refuses another ``--agent``)."""
    stream = f"session:{check_session_id(session_id.removeprefix('session:'))}"
    first = next(iter(store.read_stream(stream, 1, to_version=1)), None)
    if first is None or not isinstance(first.event, SessionCreated):
        return
    created = first.event
    for option, given, own in (
        ("agent", agent, created.agent),
        ("channel", channel, created.channel),
    ):
        if given is not None and own is not None and given != own:  # None: not recorded
            raise StalwartError(
                f"session {stream!r} belongs to {option} {own!r}, not {given!r}: "
                f"--{option} is for a new session"
            )


@session.command("send")
@click.argument("session_id", metavar="SESSION")
@click.argument("text")
@click.option("--agent", help="For a new session  [default: default].")
@click.option("--channel", help="For a new session  [default: console].")
@click.pass_obj
def send(state: _State, session_id: str, text: str, agent: str | None, channel: str | None) -> None:
    """Give SESSION a user message (durable when this returns); a worker answers it
    (TEXT `-`: read it from standard input)."""
    text = message_text(text, "TEXT")
    location = state.location or DEFAULT_STORE
    try:
        store = open_store(location, create=False)
    except StoreNotFoundError:  # say so: a mistyped --store is a store no worker reads
        store = open_store(location, create=True)
        click.echo(f"stalwart: no store was at {store.location}: created a new one", err=True)
    try:
        _check_given(store, session_id, agent, channel)
        activation = send_message(
            store, session_id, text, agent=agent or "default", channel=channel or "console"
        )
    finally:
        store.close()
    click.echo(activation)
