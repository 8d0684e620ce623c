"""``stalwart fake-provider``: the fault-injecting loopback provider as a process."""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

import click

from stalwart._text import escaped
from stalwart.config import looks_like_secret
from stalwart.errors import ConfigError
from stalwart.testing import FakeProvider, RecordedRequest, Script, load_script

from ._app import cli


def _describe(request: RecordedRequest) -> str:
    mode = "stream" if request.stream else "whole"
    model = escaped(request.model or "-")  # what the client sent: any character
    return (
        f"#{request.index} {escaped(request.api)} {model} ({mode}): {request.action}"
        f" -> {request.outcome}, HTTP {request.status}, {request.deltas_sent} deltas"
    )


@cli.command("fake-provider")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port", type=click.IntRange(0, 65535), default=0, help="Port (0: a free one, printed)."
)
@click.option(
    "--script",
    "script_path",
    type=click.Path(dir_okay=False),
    help="A TOML, YAML or JSON script of steps (default: answer every request).",
)
@click.option(
    "--api-key-env",
    metavar="NAME",
    help="Require the key held by this environment variable (401 without it).",
)
def fake_provider(host: str, port: int, script_path: str | None, api_key_env: str | None) -> None:
    """Serve the OpenAI and Anthropic APIs on loopback, playing a script of faults.

    Point a provider's base_url at the printed URL. Each request is printed when it
    ends. Stop with Ctrl-C.
    """
    script = load_script(script_path) if script_path else Script()
    api_key = None
    if api_key_env:
        if looks_like_secret(api_key_env):  # never echoed: it would be on the screen
            raise ConfigError("--api-key-env: give the name of a variable, not the key itself")
        api_key = os.environ.get(api_key_env)
        if not api_key:
            raise ConfigError(f"--api-key-env: the environment variable {api_key_env} is not set")
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        del signum, frame
        stop.set()

    previous = signal.signal(signal.SIGTERM, on_signal)
    fake = FakeProvider(script, host=host, port=port, api_key=api_key)
    try:
        fake.start()
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    click.echo(f"fake provider listening on {fake.url}; base_url for both APIs: {fake.base_url}")
    printed = 0

    def news(requests: list[RecordedRequest]) -> bool:
        return len(requests) > printed and requests[printed].outcome != "running"

    try:
        while not stop.is_set():
            try:
                requests = fake.wait_for(news, timeout=0.2)
            except TimeoutError:
                continue
            while printed < len(requests) and requests[printed].outcome != "running":
                click.echo(_describe(requests[printed]))
                printed += 1
    except KeyboardInterrupt:
        pass
    finally:
        fake.stop()
        signal.signal(signal.SIGTERM, previous)
    click.echo("fake provider stopped", err=True)
