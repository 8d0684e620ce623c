"""``stalwart session``: one session's events, and the operator's actions on it.

``confirm``, ``tool-result`` and ``interrupt`` call the runtime's session actions
(:mod:`stalwart.runtime`), which decide on the folded session and append with an expected
version; a refused action (a wrong request id, a second answer, an answer after an
interrupt, no such session) appends nothing and is one line on stderr with exit 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from stalwart.errors import SessionActionError
from stalwart.runtime import confirm, interrupt, submit_tool_result

from ._app import _State, session
from ._render import event_json, event_line
from ._views import session_stream


@session.command("events")
@click.argument("session_id", metavar="SESSION")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new events until Ctrl-C.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line (as tail).")
@click.pass_obj
def events(state: _State, session_id: str, follow: bool, as_json: bool) -> None:
    """Print SESSION's stream, rendered like `stalwart tail`."""
    stream = session_stream(session_id)
    render = event_json if as_json else event_line
    store = state.store()
    try:
        head = store.head()
        if store.stream_version(stream) == 0 and not follow:
            raise SessionActionError(
                f"no session {stream!r} in {store.location}", reason="no_session", session=stream
            )
        subscription = None
        try:  # with --follow, Ctrl-C ends it normally, in the history as in the live part
            for record in store.read_stream(stream):
                if record.position <= head:
                    _print(render(record))
            if not follow:
                return
            subscription = store.subscribe(head + 1)
            for record in subscription:
                if record.stream == stream:
                    _print(render(record))
        except KeyboardInterrupt:
            if not follow:
                raise
            if subscription is not None:
                subscription.close()
    finally:
        store.close()


def _print(line: str) -> None:
    click.echo(line)
    sys.stdout.flush()


@session.command("confirm")
@click.argument("session_id", metavar="SESSION")
@click.argument("request_id", metavar="REQUEST")
@click.option("--allow", is_flag=True, help="Run the tool once with its stored input.")
@click.option("--deny", is_flag=True, help="Refuse it (one of --allow and --deny is required).")
@click.pass_obj
def confirm_command(
    state: _State, session_id: str, request_id: str, allow: bool, deny: bool
) -> None:
    """Answer SESSION's pending approval REQUEST; the session resumes."""
    if allow == deny:  # neither, or both: which did the operator mean?
        raise click.UsageError("say one of --allow and --deny")
    store = state.store_to_write()
    try:
        activation = confirm(store, session_id, request_id, allow=allow)
    finally:
        store.close()
    verdict = "allowed" if allow else "denied"
    click.echo(
        f"{verdict} request {request_id} of {session_stream(session_id)}; "
        f"resume queued as activation {activation}"
    )


@session.command("tool-result")
@click.argument("session_id", metavar="SESSION")
@click.argument("request_id", metavar="REQUEST")
@click.option("--output", "output_text", metavar="TEXT", help="The tool's output.")
@click.option(
    "--output-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    metavar="FILE",
    help="Read the tool's output from FILE (UTF-8).",
)
@click.pass_obj
def tool_result(
    state: _State,
    session_id: str,
    request_id: str,
    output_text: str | None,
    output_file: Path | None,
) -> None:
    """Give SESSION's pending custom tool REQUEST its output; the session resumes."""
    if (output_text is None) == (output_file is None):
        raise click.UsageError("give exactly one of --output TEXT and --output-file FILE")
    if output_file is not None:
        try:
            # its bytes as they are: text mode would rewrite CRLF and CR line ends
            output_text = output_file.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise click.UsageError(
                f"cannot read --output-file {str(output_file)!r}: {exc}"
            ) from exc
    assert output_text is not None
    store = state.store_to_write()
    try:
        activation = submit_tool_result(store, session_id, request_id, output_text)
    finally:
        store.close()
    click.echo(
        f"tool result for request {request_id} of {session_stream(session_id)} recorded "
        f"({len(output_text)} chars); resume queued as activation {activation}"
    )


@session.command("interrupt")
@click.argument("session_id", metavar="SESSION")
@click.option("--reason", default="operator", show_default=True, help="Recorded with it.")
@click.pass_obj
def interrupt_command(state: _State, session_id: str, reason: str) -> None:
    """Interrupt SESSION: clear its pending request, cancel its queued activations and
    fence out a wake still running."""
    store = state.store_to_write()
    try:
        cancelled = interrupt(store, session_id, reason)
    finally:
        store.close()
    noun = "activation" if len(cancelled) == 1 else "activations"
    click.echo(
        f"interrupted {session_stream(session_id)}: {len(cancelled)} queued {noun} cancelled"
        + (f" ({', '.join(cancelled)})" if cancelled else "")
    )
